#!/usr/bin/env bash
# One device call on an H200 (carry .whl and .models/old41, the tree at 9110568): #18's measures on the card the
# issue names: the throughput workload (this tree and 9110568 alternating), batch-1 / batch-32 decode latency,
# the server at rate inf against the offline engine. Logs as $OUT/h200_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/h200_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/h200_round.tgz" .); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $out/gpu.log
run() {  # tree label, bench script and its arguments
  local label=$1 root=$here; shift; [ $label = old ] && root=$here/.models/old41
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$label timeout 150 python3 -u "$@") 2>&1 \
    | grep -v "^Triton compiled\|it/s\]" | sed "s/^/$label: /" > $out/$label.$2.log
  grep "% of the floor\|floor\|x the\|tok/s" $out/$label.$2.log | tail -12
  bundle
}
for tree in new old new; do run $tree throughput.py --async-scheduling --hf-seqs 0; done
run new latency.py --skip-hf --prefill-contexts 8192 --async-scheduling
(cd bench && OUT=$out timeout 240 python3 -u serving.py --request-rates inf --num-prompts 1000 --client-processes 8 \
  --api-server-count 2 --async-scheduling) 2>&1 | grep -v "it/s\]" > $out/serving.log
tail -15 $out/serving.log
bundle
