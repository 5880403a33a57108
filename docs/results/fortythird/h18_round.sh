#!/usr/bin/env bash
# One device call (carry .whl): issue #18's five items on whatever card comes, this tree only, with the commands the
# issue's figures were measured with: latency (items 2, 3 against HF's forward in the same process, 4's first-request
# TTFT), the throughput workload (item 1), the server at rate inf against the offline engine (item 5).
# Logs as $OUT/h18_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
out=/tmp/h18_round; mkdir -p $out
bundle() { (cd $out && tar czf "$OUT/h18_round.tgz" .); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $out/gpu.log
step() {  # name, timeout, bench script and its arguments
  local name=$1 limit=$2; shift 2
  (cd bench && PYTHONPATH=$PYTHONPATH:$PWD OUT=$out/$name timeout $limit python3 -u "$@") 2>&1 \
    | grep -v "^Triton compiled\|it/s\]" > $out/$name.log
  if [ $name = serving ]; then tail -6 $out/$name.log
  else grep "ms/token\|% of the floor\|prefill\|start-up" $out/$name.log; fi
  bundle
}
step latency 240 latency.py --prefill-contexts 32768 --async-scheduling
step throughput 130 throughput.py --async-scheduling --hf-seqs 0
step serving 240 serving.py --request-rates inf --num-prompts 1000 --client-processes 8 --api-server-count 2 \
  --async-scheduling
