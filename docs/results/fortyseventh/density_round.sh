#!/usr/bin/env bash
# Issue #15: the end-to-end 128K prefill at threshold 0.2 (density 0.208) and, the same XAttention engine, at
# thresholds that give densities at and below the 0.2; dense in the same runs. From the repo root on the
# device machine:
#   bash docs/results/fortyseventh/density_round.sh
# Log and JSON go to $OUT (or /tmp/round).
set -u
source bench/device/on_device.sh
out=${OUT:-/tmp/round}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(cd bench && OUT=$out timeout 400 python3 sparse.py --e2e-contexts 131072 --e2e-chunk 32768 \
  --e2e-peer-thresholds 0.19 0.15 0.1 --skip-prefill --skip-offload --skip-gpu-only > "$out/e2e_density.log" 2>&1)
grep "end-to-end" "$out/e2e_density.log" || tail -5 "$out/e2e_density.log"
