#!/usr/bin/env bash
# One device call (carry .whl and .models/head40, the tree at the session's start): the prefill kernel's lazy
# rescale against the eager one in one process (one XAttention layer at 128K, the dense chunks), the end-to-end
# 128K XAttention prefill of this tree and the session's start alternating, the prefill kernels' CUDA tests.
# Logs as $OUT/lazy_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
here=$PWD back=$OUT out=/tmp/lazy_round
mkdir -p $out
bundle() { (cd $out && tar czf "$back/lazy_round.tgz" .); }
(cd bench && timeout 120 python3 -u tune_prefill.py --xattention-contexts 131072 --threshold 0.2 --block-m 128 \
  --block-n 64 --warps 4 --stages 3 --tma 1 --pack 0 --lazy 0 1) 2>&1 | grep -v "^Triton compiled" \
  | tee $out/tune_xattention.log | tail -4
(cd bench && timeout 120 python3 -u tune_prefill.py --prefixes 0 24576 --block-m 128 --block-n 64 --warps 4 \
  --stages 3 --tma 1 --pack 0 --lazy 0 1) 2>&1 | grep -v "^Triton compiled" | tee $out/tune_dense.log | tail -6
bundle
e2e() {  # tree label
  local root=$here; [ $1 = old ] && root=$here/.models/head40
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site timeout 150 python3 -u sparse.py --e2e-contexts 131072 \
    --e2e-chunk 32768 --skip-prefill --skip-offload --skip-gpu-only) 2>&1 | grep "end-to-end" | sed "s/^/$1: /" \
    | tee -a $out/e2e_ab.log
  bundle
}
e2e new; e2e old
timeout 100 python3 -m pytest -q tests/test_kernels.py -k "prefill or lazy" 2>&1 | tail -2 | tee $out/tests.log
bundle
e2e new; e2e old
