#!/usr/bin/env bash
# Issue #18 on nvidia-h200 (repo root there; after `source bench/device/on_device.sh; wheels`), one part per call (each
# under the 600 s limit), logs under $OUT:
#   bash bench/device/speed_round.sh tests          CUDA tests of the kernels this round changed (decode split early
#                                                   return and merge, RoPE with the KV store, GEMV) and the compile watch
#   bash bench/device/speed_round.sh tune           tune_gemv (Llama-3.1-8B, 1 / 4 rows; cuBLAS, cuBLASLt, the GEMV at
#                                                   its tiles and swept, the engine's choice per layer) and tune_decode
#   bash bench/device/speed_round.sh latency OLD    batch-1 decode at 1K / 32K and batch 32 at 1K: the tree OLD (a `git
#                                                   archive` of the commit before the round, carried as an ignored
#                                                   folder) and this one alternating, synchronous
#   bash bench/device/speed_round.sh latency2       this tree, async scheduling: the GEMV at 1 row (the default) and
#                                                   cuBLAS (--gemv-rows 0) alternating
#   bash bench/device/speed_round.sh pdl            the dependent-launch CUDA tests, then batch-1 decode at 1K / 32K
#                                                   and batch 32 at 1K, async, with and without --dependent-launch
#                                                   alternating, twice
#   bash bench/device/speed_round.sh pdl_throughput the throughput workload (async) with and without
#                                                   --dependent-launch alternating, twice
#   bash bench/device/speed_round.sh profile        profile_decode at batch 1 (cuBLAS, the GEMV) and at the
#                                                   throughput workload's batch 256 (Qwen3-0.6B shape)
#   bash bench/device/speed_round.sh serving [OLD]  the server at rate inf against the offline engine (its time in
#                                                   steps, busy by tenths); with OLD that tree's server and this one's
#                                                   alternating, twice (the offline peer only in the first run)
#   bash bench/device/speed_round.sh serving stack  the same, the front ends on uvloop + httptools (the default) and
#                                                   on asyncio + h11 alternating, twice
set -euo pipefail
source "$(dirname "$0")/on_device.sh"
out=${OUT:-/tmp/out}
mkdir -p "$out"
here=$PWD
quiet() { grep -v "^Triton compiled" || true; }
latency() {  # TREE NAME ARGS...: bench/latency.py of that tree
  local tree=$1 name=$2; shift 2
  (cd "$tree/bench" && PYTHONPATH=$tree:/tmp/site OUT=$out/$name python3 -u latency.py --skip-hf \
    --prefill-contexts 8192 "$@") 2>&1 | quiet | tee "$out/$name.log"
}
case ${1:-} in
  tests)
    python3 -m pytest -q -x -m cuda tests/test_kernels.py tests/test_fused_ops.py tests/test_gemv.py \
      tests/test_compile_watch.py 2>&1 | tail -15 | tee "$out/tests.log" ;;
  tune)
    (cd bench && python3 -u tune_gemv.py --quick) 2>&1 | quiet | tee "$out/tune_gemv.log"
    (cd bench && python3 -u tune_decode.py --quick) 2>&1 | quiet | tee "$out/tune_decode.log" ;;
  latency)
    old=$(realpath "${2:?the folder of the old tree}")
    latency "$old" old_sync
    latency "$here" new_sync
    latency "$old" old_sync2 --cases 1x1024
    latency "$here" new_sync2 --cases 1x1024 ;;
  latency2)
    for run in 1 2; do
      latency "$here" async_gemv$run --async-scheduling --cases 1x1024 1x32768
      latency "$here" async_cublas$run --async-scheduling --gemv-rows 0 --cases 1x1024 1x32768
    done ;;
  pdl)
    python3 -m pytest -q -x -m cuda tests/test_dependent_launch.py tests/test_gemv.py tests/test_fused_ops.py 2>&1 \
      | tail -3 | tee "$out/tests_pdl.log"
    for run in 1 2; do
      latency "$here" async_pdl$run --async-scheduling --dependent-launch
      latency "$here" async_plain$run --async-scheduling --no-dependent-launch
    done ;;
  pdl_throughput)
    for run in 1 2; do
      for flag in --dependent-launch --no-dependent-launch; do
        if [ "$flag" = --dependent-launch ]; then name=throughput_pdl$run; else name=throughput_plain$run; fi
        (cd bench && PYTHONPATH=$here:/tmp/site OUT=$out/$name python3 -u throughput.py --async-scheduling \
          --hf-seqs 0 $flag) 2>&1 | quiet | tee "$out/$name.log"
      done
    done ;;
  profile)
    for rows in 0 1; do
      (cd bench && OUT=$out/profile_b1_gemv$rows python3 -u profile_decode.py --gemv-rows $rows) 2>&1 | quiet \
        | tee "$out/profile_b1_gemv$rows.log"
    done
    (cd bench && OUT=$out/profile_b256 python3 -u profile_decode.py --config configs/qwen3-0.6b --batch 256 \
      --context 600) 2>&1 | quiet | tee "$out/profile_b256.log" ;;
  serving)
    serve() {  # TREE NAME ARGS...
      local tree=$1 name=$2; shift 2
      (cd "$tree" && PYTHONPATH=$tree:/tmp/site python3 -u bench/serving.py --request-rates inf --num-prompts 1000 \
        --client-processes 8 --api-server-count 2 --async-scheduling --output-dir "$out" --name "$name" "$@") 2>&1 \
        | quiet | tee "$out/$name.log"
    }
    if [ "${2:-}" = stack ]; then  # uvloop + httptools (the default) and asyncio + h11 alternating
      serve "$here" serving_fast
      serve "$here" serving_plain --no-offline --uvicorn-loop asyncio --uvicorn-http h11
      serve "$here" serving_fast2 --no-offline
      serve "$here" serving_plain2 --no-offline --uvicorn-loop asyncio --uvicorn-http h11
      exit 0
    fi
    serve "$here" serving_new
    if [ -n "${2:-}" ]; then
      old=$(realpath "$2")
      serve "$old" serving_old --no-offline
      serve "$here" serving_new2 --no-offline
      serve "$old" serving_old2 --no-offline
    fi ;;
  *) echo "bash bench/device/speed_round.sh tests|tune|latency OLD|latency2|pdl|profile|serving [OLD|stack]" >&2; exit 2 ;;
esac
