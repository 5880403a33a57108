#!/usr/bin/env bash
# One device call: the throughput workload with plain decode graphs and with two-stream ones (two_streams.py),
# alternating. Usage: bash docs/results/fortythird/two_streams.sh SPLIT_MIN [extra throughput.py args]
set -uo pipefail
source bench/device/on_device.sh
split=$1; shift
out=/tmp/two_streams; mkdir -p $out
nvidia-smi --query-gpu=name --format=csv,noheader | tee $out/gpu.log
for run in split1 plain1 split2 plain2; do
  min=0; [ ${run%?} = split ] && min=$split
  (cd bench && SPLIT_MIN=$min PYTHONPATH=$PYTHONPATH:$PWD OUT=$out/$run timeout 110 python3 -u \
    ../docs/results/fortythird/two_streams.py --async-scheduling --hf-seqs 0 "$@") 2>&1 \
    | grep -v "^Triton compiled\|it/s\]" > $out/$run.log
  echo "$run: $(grep -i "floor\|Error\|error" $out/$run.log | tail -3 | tr '\n' ' ')"
  (cd $out && tar czf "$OUT/two_streams.tgz" .)
  grep -q "of the floor" $out/$run.log || { tail -30 $out/$run.log; exit 1; }
done
