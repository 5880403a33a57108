#!/usr/bin/env bash
# The next device call (carry .whl and .models/old40, the tree at 345f7a7: `mkdir -p .models/old40 && git archive
# 345f7a7 nanovllm | tar -x -C .models/old40`): the Triton sampler split over the vocabulary against one program per
# row (bench/sampler.py, one process); the throughput workload and the end-to-end 128K XAttention prefill (a sparse
# step's counts no longer read with a sync), this tree and 345f7a7 alternating. Logs as $OUT/next_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/next_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/next_round.tgz" .); }
(cd bench && OUT=$out timeout 90 python3 -u sampler.py) 2>&1 | grep -v "^Triton compiled" | tee $out/sampler.log
bundle
run() {  # tree label, bench script and its arguments
  local label=$1 root=$here; shift; [ $label = old ] && root=$here/.models/old40
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$label timeout 150 python3 -u "$@") 2>&1 \
    | grep "% of the floor\|end-to-end" | sed "s/^/$label: /" | tee -a $out/ab.log
  bundle
}
for tree in new old new old; do run $tree throughput.py --async-scheduling --hf-seqs 0; done
for tree in new old; do
  run $tree sparse.py --e2e-contexts 131072 --e2e-chunk 32768 --skip-prefill --skip-offload --skip-gpu-only
done
