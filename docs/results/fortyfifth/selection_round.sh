#!/usr/bin/env bash
# Issue #15's next GPU call (written in the forty-fifth session, which got no device): the covering and
# group-tables kernels on the GPU against their PyTorch paths, then the end-to-end 128K prefill with them as a
# peer, then where the XAttention prefill's time goes now. From the repo root on the device machine:
#   bash docs/results/fortyfifth/selection_round.sh
# Logs go to $OUT (or /tmp/round). If the peer is faster, turn them on by default: XAttentionSelector.fused_covering
# None and AttentionBackend.group_tables_kernel True. (Run in the forty-sixth session: no faster; the kernels
# were removed after it, so this script runs only on commit c793590.)
set -u
source bench/device/on_device.sh
out=${OUT:-/tmp/round}
mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q tests/test_group_tables.py tests/test_xattention_kernel.py \
  -k "covering or group_tables or default" 2>&1 | tail -3
(cd bench && timeout 300 python3 sparse.py --e2e-contexts 131072 --e2e-chunk 32768 --triton-selection-peer \
  --skip-prefill --skip-offload --skip-gpu-only > "$out/e2e_selection.log" 2>&1)
grep "end-to-end" "$out/e2e_selection.log"
(cd bench && PYTHONPATH=$PYTHONPATH:$PWD timeout 150 python3 ../docs/results/thirtyninth/e2e_probe.py \
  --policies xattention --triton-selection \
  > "$out/e2e_probe.log" 2>&1)
grep -v "^  shape" "$out/e2e_probe.log" | grep -v Warn | head -40
