#!/usr/bin/env bash
# One device call, the parts of phases_round.sh and sums_round.sh by priority, each bundled as it ends
# ($OUT/combined.tgz): the serving phases; the sums kernel old / new end to end; the estimate's ops by shape; the
# whole 128K prompt as one chunk; the kernel's CUDA tests.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/combined
mkdir -p $out && rm -f /tmp/phases_*
bundle() { (cd $out && tar czf "$back/combined.tgz" .); }
NANOVLLM_PHASES=1 PYTHONPATH=$here/docs/results/thirtyninth/phases:$PYTHONPATH timeout 150 python3 -u bench/serving.py \
  --request-rates inf --num-prompts 1000 --client-processes 8 --api-server-count 2 --async-scheduling \
  --output-dir $out --name phases 2>&1 | grep -v "^Triton compiled" > $out/phases.log
grep -h "output tok/s\|^peer" $out/phases.log
cp /tmp/phases_*.txt $out/
python3 docs/results/thirtyninth/phases_summary.py /tmp | tee $out/phases_summary.log | grep -v "none\|prefill "
bundle
e2e() {  # tree label, chunk
  local root=$here; [ $1 = old ] && root=$here/.models/old39
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site timeout 150 python3 -u sparse.py --e2e-contexts 131072 \
    --e2e-chunk $2 --skip-prefill --skip-offload --skip-gpu-only) 2>&1 | grep "end-to-end" | sed "s/^/$1: /" \
    | tee -a $out/e2e_ab.log
  bundle
}
e2e old 32768
e2e new 32768
(cd bench && PYTHONPATH=$PWD:$PYTHONPATH timeout 100 python3 -u $here/docs/results/thirtyninth/e2e_probe.py \
  --policies xattention) 2>&1 | grep -v "^Triton compiled" > $out/e2e_shapes.log
grep -v "^  shape\|^  kernel" $out/e2e_shapes.log | tail -4
bundle
e2e new 131072
timeout 60 python3 -m pytest -q tests/test_xattention_kernel.py 2>&1 | tail -2 | tee $out/tests.log
bundle
