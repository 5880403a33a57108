#!/usr/bin/env bash
# One device call (carry .whl and .models/old41, the tree at 9110568: `mkdir -p .models/old41 && git archive
# 9110568 nanovllm | tar -x -C .models/old41`): the sampler's CUDA tests; bench/sampler.py (one Philox call per
# four entries; 16-bit logits read as they are); the decode GEMMs, cuBLAS against Triton tiles (gemm_probe.py);
# the throughput workload, this tree and 9110568 alternating. Logs as $OUT/sampler_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/sampler_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/sampler_round.tgz" .); }
timeout 120 python3 -m pytest -q tests/test_sampler.py -k fused 2>&1 | tail -4 | tee $out/tests.log
for tree_dtype in new:bfloat16 new:float32 old:float32 old:bfloat16; do
  tree=${tree_dtype%:*} root=$here; [ $tree = old ] && root=$here/.models/old41
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$tree timeout 60 python3 -u sampler.py \
    --dtype ${tree_dtype#*:}) 2>&1 \
    | grep -v "^Triton compiled" | sed "s/^/$tree: /" | tee -a $out/sampler.log
done
bundle
run() {  # tree label, bench script and its arguments
  local label=$1 root=$here; shift; [ $label = old ] && root=$here/.models/old41
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$label timeout 120 python3 -u "$@") 2>&1 \
    | grep "% of the floor" | sed "s/^/$label: /" | tee -a $out/ab.log
  bundle
}
for tree in new old new old; do run $tree throughput.py --async-scheduling --hf-seqs 0; done
timeout 200 python3 -u docs/results/fortyfirst/gemm_probe.py 2>&1 | grep -v "^Triton compiled" | tee $out/gemm.log
bundle
