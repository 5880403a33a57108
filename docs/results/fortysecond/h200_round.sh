#!/usr/bin/env bash
# For the next H200 call (carry .whl and .models/old42, the tree at 2ab60ee): issue #18's items on the card the issue
# names, this tree against 2ab60ee: batch-1 / batch-32 decode latency (new, old, new), the throughput workload
# (new, old), the server at rate inf. Logs as $OUT/h200_round.tgz. Not run in the forty-second session (no H200 came
# after its first two calls).
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/h200_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/h200_round.tgz" .); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $out/gpu.log
run() {  # label (new1, old1, ...), bench script and its arguments
  local label=$1 root=$here; shift; [ ${label%?} = old ] && root=$here/.models/old42
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$label timeout 150 python3 -u "$@") 2>&1 \
    | grep -v "^Triton compiled\|it/s\]" > $out/$label.$1.log
  grep "ms/token\|% of the floor" $out/$label.$1.log | sed "s/^/$label: /; s/TTFT.*-> [0-9.]*x),//"
  bundle
}
for label in new1 old1 new2; do run $label latency.py --skip-hf --prefill-contexts 8192 --async-scheduling; done
for label in new3 old2; do run $label throughput.py --async-scheduling --hf-seqs 0; done
(cd bench && OUT=$out timeout 240 python3 -u serving.py --request-rates inf --num-prompts 1000 --client-processes 8 \
  --api-server-count 2 --async-scheduling) 2>&1 | grep -v "it/s\]" > $out/serving.log
tail -6 $out/serving.log
bundle
