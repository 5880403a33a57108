#!/usr/bin/env bash
# Issue #20 on nvidia-h200-x2 (repo root there; after `source bench/device/on_device.sh; wheels`), one part per call
# (each well under the 600 s limit), results and logs under $OUT:
#   bash bench/device/tp2.sh main      the 8B shape, random bf16 weights: greedy agreement TP=2 vs TP=1 (16 prompts,
#                                      top-2 gaps at divergences), batch-1 decode at 1K and 32K against each TP
#                                      size's HBM floor, the throughput workload
#   bash bench/device/tp2.sh offload   batch-1 decode at 128K with the KV offloaded, each rank a 24 GB card's pool
#   bash bench/device/tp2.sh smol      SmolLM2's own weights in fp32: greedy agreement and batch-1 decode at 1K
#                                      (needs /tmp/smol: carry .models/smol/s.part00-01 with `keep`, `assemble smol`)
# NCCL's NVLink multicast stays off (the executor sets NCCL_NVLS_ENABLE=0 for the workers).
set -euo pipefail
source "$(dirname "$0")/on_device.sh"
out=${OUT:-/tmp/out}
mkdir -p "$out"
case ${1:-main} in
  main)
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    (cd bench && python3 -u tensor_parallel.py --tp 1 2 --agreement-prompts 16 --contexts 1024 32768 \
      --out "$out/tp_8b.json") 2>&1 | grep -v "^Triton compiled" | tee "$out/tp_8b.log" ;;
  offload)
    (cd bench && python3 -u tensor_parallel.py --tp 1 2 --agreement-prompts 2 --agreement-tokens 8 --contexts 1024 \
      --skip-throughput --offload-context 131072 --out "$out/tp_offload.json") 2>&1 | grep -v "^Triton compiled" \
      | tee "$out/tp_offload.log" ;;
  smol)
    (cd bench && python3 -u tensor_parallel.py --tp 1 2 --model /tmp/smol --real-weights --dtype float32 \
      --agreement-prompts 16 --contexts 1024 --skip-throughput --out "$out/tp_smol.json") 2>&1 \
      | grep -v "^Triton compiled" | tee "$out/tp_smol.log" ;;
  *) echo "bash bench/device/tp2.sh main|offload|smol" >&2; exit 2 ;;
esac
