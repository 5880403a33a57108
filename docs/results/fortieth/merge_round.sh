#!/usr/bin/env bash
# One device call (carry .whl and .models/head40, the tree at the session's start): the decode kernels' CUDA tests
# (the last split merging the others), then batch-1 decode at 1K / 32K and batch 32 at 1K with async scheduling,
# this tree and the session's start alternating, twice; then the server at rate inf against the offline engine
# (issue #18 item 5), as time allows. Logs as $OUT/merge_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/merge_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/merge_round.tgz" .); }
timeout 150 python3 -m pytest -q -x tests/test_kernels.py -k "decode or split or merge or accumulate" 2>&1 | tail -2 \
  | tee $out/tests.log
bundle
latency() {  # tree label
  local root=$here; [ $1 = old ] && root=$here/.models/head40
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$1_$2 timeout 150 python3 -u latency.py --skip-hf \
    --prefill-contexts 8192 --async-scheduling) 2>&1 | grep -v "^Triton compiled" > $out/latency_$1_$2.log
  grep "ms per token\|ms/token\|floor" $out/latency_$1_$2.log | sed "s/^/$1: /" | tee -a $out/latency_ab.log
  bundle
}
latency new 1; latency old 1; latency new 2; latency old 2
for run in 1 2; do
  timeout 140 python3 -u bench/serving.py --request-rates inf --num-prompts 1000 --client-processes 8 \
    --api-server-count 2 --async-scheduling --output-dir $out --name serving$run 2>&1 \
    | grep "output tok/s\|^peer\|engine steps" | tee -a $out/serving.log
  bundle
done
