#!/usr/bin/env bash
# One device call: the one-pass softmax-granule-sums kernel (this tree) against the two-pass one (.models/old39,
# carried), end to end: 128K XAttention prefill against dense (bench/sparse.py), old / new; then the
# kernel's CUDA tests; the new tree at chunks of 64K and 128K. Logs as $OUT/sums_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
here=$PWD back=$OUT out=/tmp/sums_round
mkdir -p $out
for tree in old new; do
  root=$here; [ $tree = old ] && root=$here/.models/old39
  (cd bench && PYTHONPATH=$root:$here/bench:/tmp/site timeout 170 python3 -u sparse.py --e2e-contexts 131072 \
    --e2e-chunk 32768 --skip-prefill --skip-offload --skip-gpu-only) 2>&1 | grep "end-to-end" | sed "s/^/$tree: /" \
    | tee -a $out/e2e_ab.log
done
for chunk in 65536 131072; do
  (cd bench && timeout 150 python3 -u sparse.py --e2e-contexts 131072 --e2e-chunk $chunk --skip-prefill --skip-offload \
    --skip-gpu-only) 2>&1 | grep "end-to-end" | sed "s/^/new: /" | tee -a $out/e2e_ab.log
done
timeout 120 python3 -m pytest -q tests/test_xattention_kernel.py 2>&1 | tail -3 | tee $out/tests.log
(cd $out && tar czf "$back/sums_round.tgz" .)
