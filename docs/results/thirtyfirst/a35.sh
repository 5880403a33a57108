#!/usr/bin/env bash
# Session 31, call A: CUDA tests of host keys from the copy, then the offload decode bench at 1 x 128K
source bench/device/on_device.sh
[ -d /tmp/site/annotated_types ] || wheels
python3 -m pytest -q -x tests/test_kernels.py tests/test_quest_key_copy.py tests/test_narrowed.py \
  -k "host or key_codes or narrowed" 2>&1 | tail -5
(cd bench && python3 -u sparse.py --skip-prefill --skip-gpu-only --decode-cases 1x131072 --budgets 2048 4096 \
  --key-copy-peer --copied-host-keys-peer --async-peer --decode-steps 16) 2>&1 | grep -v Warning | tee $OUT/offload1.log | tail -40
