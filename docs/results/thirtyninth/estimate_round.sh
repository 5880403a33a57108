#!/usr/bin/env bash
# One device call: one layer's XAttention estimate at 128K (estimate_ab.py), .models/old39 (carried) and this tree
# alternating, then the gather kernel's CUDA tests. Log as $OUT/estimate_ab.log.
set -uo pipefail
source bench/device/on_device.sh
for tree in old new old new; do
  root=$PWD; [ $tree = old ] && root=$PWD/.models/old39
  PYTHONPATH=$root timeout 60 python3 docs/results/thirtyninth/estimate_ab.py $tree 2>&1 | grep -v "^Triton compiled"
done | tee $OUT/estimate_ab.log
timeout 60 python3 -m pytest -q tests/test_xattention_kernel.py -k "gather_rows or softmax" 2>&1 | tail -1 \
  | tee -a $OUT/estimate_ab.log
