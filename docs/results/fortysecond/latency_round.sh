#!/usr/bin/env bash
# One device call (carry .models/old42, the tree at 2ab60ee): batch-1 / batch-32 decode latency of this tree and
# 2ab60ee alternating (new, old, new, old), then the CUDA tests of the changed kernels and models. Logs as $OUT/latency_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
here=$PWD back=$OUT out=/tmp/latency_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/latency_round.tgz" .); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $out/gpu.log
run() {  # tree label, run number, bench script and its arguments
  local label=$1 n=$2 root=$here; shift 2; [ $label = old ] && root=$here/.models/old42
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site OUT=$out/$label$n timeout 150 python3 -u "$@") 2>&1 \
    | grep -v "^Triton compiled\|it/s\]" | sed "s/^/$label: /" > $out/$label$n.log
  grep "ms/token" $out/$label$n.log | sed 's/TTFT.*-> [0-9.]*x),//'
  bundle
}
for n in 1 2; do
  for tree in new old; do run $tree $n latency.py --skip-hf --prefill-contexts 8192 --async-scheduling; done
done
timeout 260 python3 -m pytest -q -m cuda tests/test_kernels.py tests/test_dependent_launch.py tests/test_compile_watch.py \
  tests/test_gemv.py tests/test_fused_ops.py tests/test_decode_graphs.py tests/test_models_hf.py \
  2>&1 | tail -4 | tee $out/cuda_tests.log
bundle
