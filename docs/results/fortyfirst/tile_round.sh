#!/usr/bin/env bash
# One device call (carry .whl and .models/old41b, the tree at 1f90649: `mkdir -p .models/old41b && git archive
# 1f90649 nanovllm | tar -x -C .models/old41b`): the kernels' CUDA tests; the throughput workload and batch-1 /
# batch-32 decode latency, this tree (one-split decode launches in 128-key tiles) and 1f90649 alternating.
# Logs as $OUT/tile_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/tile_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/tile_round.tgz" .); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $out/gpu.log
timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_sampler.py 2>&1 | tail -3 | tee $out/tests.log
run() {  # tree label, log name, bench script and its arguments
  local label=$1 name=$2 root=$here; shift 2; [ $label = old ] && root=$here/.models/old41b
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$label timeout 150 python3 -u "$@") 2>&1 \
    | grep -v "^Triton compiled\|it/s\]" | sed "s/^/$label: /" >> $out/$name.log
  grep "% of the floor\|x the floor" $out/$name.log | tail -3
  bundle
}
for tree in new old new old; do run $tree throughput throughput.py --async-scheduling --hf-seqs 0; done
for tree in new old; do run $tree latency latency.py --skip-hf --prefill-contexts 8192 --async-scheduling; done
