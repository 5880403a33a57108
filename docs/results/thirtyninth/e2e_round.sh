#!/usr/bin/env bash
# One device call: where the end-to-end 128K XAttention prefill leaves the GPU idle (e2e_probe.py), dense beside it.
# Log as $OUT/e2e_probe.log.
set -uo pipefail
source bench/device/on_device.sh
probe=$PWD/docs/results/thirtyninth/e2e_probe.py
(cd bench && PYTHONPATH=$PWD:$PYTHONPATH timeout 560 python3 -u "$probe" "$@") 2>&1 | grep -v "^Triton compiled" \
  | tee $OUT/e2e_probe.log | grep -v "^  kernel"
