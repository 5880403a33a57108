#!/usr/bin/env bash
# One device call (carry .models/head40): the end-to-end 128K XAttention prefill with the granule-sums kernel's
# 1,024-column blocks (this tree) and the session's start alternating; the kernel's CUDA tests. $OUT/sums_e2e.tgz.
set -uo pipefail
source bench/device/on_device.sh
here=$PWD back=$OUT out=/tmp/sums_e2e
mkdir -p $out
bundle() { (cd $out && tar czf "$back/sums_e2e.tgz" .); }
e2e() {  # tree label
  local root=$here; [ $1 = old ] && root=$here/.models/head40
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site timeout 150 python3 -u sparse.py --e2e-contexts 131072 \
    --e2e-chunk 32768 --skip-prefill --skip-offload --skip-gpu-only) 2>&1 | grep "end-to-end" | sed "s/^/$1: /" \
    | tee -a $out/e2e_ab.log
  bundle
}
e2e new; e2e old
timeout 60 python3 -m pytest -q tests/test_xattention_kernel.py 2>&1 | tail -2 | tee $out/tests.log
bundle
e2e new
