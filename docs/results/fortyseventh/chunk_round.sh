#!/usr/bin/env bash
# Issue #15: the end-to-end 128K prefill, dense against XAttention, at three chunk sizes (both engines'
# max_num_batched_tokens) on whichever card comes; each engine is compared at its best chunking. From the repo
# root on the device machine:
#   bash docs/results/fortyseventh/chunk_round.sh [CHUNK...]
# Logs and JSON go to $OUT (or /tmp/round).
set -u
source bench/device/on_device.sh
out=${OUT:-/tmp/round}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
chunks=("$@")
[ ${#chunks[@]} -gt 0 ] || chunks=(32768 65536 16384)
for chunk in "${chunks[@]}"; do
  (cd bench && OUT=$out/c$chunk timeout 200 python3 sparse.py --e2e-contexts 131072 --e2e-chunk "$chunk" \
    --skip-prefill --skip-offload --skip-gpu-only > "$out/e2e_$chunk.log" 2>&1)
  grep "end-to-end" "$out/e2e_$chunk.log" || tail -5 "$out/e2e_$chunk.log"
done
