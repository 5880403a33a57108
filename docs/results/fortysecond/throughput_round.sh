#!/usr/bin/env bash
# One device call (carry .models/old42, the tree at 2ab60ee): the throughput workload, this tree and 2ab60ee
# alternating (new, old, new). Logs as $OUT/throughput_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
here=$PWD back=$OUT out=/tmp/throughput_round
mkdir -p $out
nvidia-smi --query-gpu=name --format=csv,noheader | tee $out/gpu.log
for run in new1 old1 new2; do
  root=$here; [ ${run%?} = old ] && root=$here/.models/old42
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$run timeout 110 python3 -u throughput.py \
    --async-scheduling --hf-seqs 0) 2>&1 | grep -v "^Triton compiled\|it/s\]" > $out/$run.log
  echo "$run: $(grep -i "floor" $out/$run.log | tail -2 | tr '\n' ' ')"
  (cd $out && tar czf "$back/throughput_round.tgz" .)
done
