#!/usr/bin/env bash
# Issue #15's accuracy table at the engine's defaults, on the device machine, in the background (the runs outlive
# the call; `wait_runs` and `tables` in on_device.sh collect them): full, xattention, quest and xattention+quest,
# one process per policy and cell sharing the GPU.
#   SmolLM2-135M bf16, 13 tasks x 50 samples at 4K and 8K (sparse_min_context 0, a fixed pool);
#   Qwen2.5-Coder-0.5B bf16, the 8 niah tasks at 16K and 32K in offload mode (16 device blocks), the samples file's
#   count per task.
# Needs /tmp/smol and /tmp/qwen (on_device.sh's `assemble`) and the samples files in /tmp/m (`keep`).
# Usage (repo root there): bash bench/device/sparse_table.sh OUT_DIR [smol] [qwen]   (default: both)
# Variants of the defaults: POLICIES (a subset), EXTRA (more engine options for every run) and TAG (added to the
# runs' names), e.g. POLICIES=quest EXTRA="--quest-rerank 4" TAG=_rr4 bash bench/device/sparse_table.sh OUT qwen
set -euo pipefail
source "$(dirname "$0")/on_device.sh"
out=$1; shift
POLICIES=${POLICIES:-"full xattention quest xattention+quest"}
EXTRA=${EXTRA:-}
TAG=${TAG:-}
NIAH="niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery"
for model in "${@:-smol qwen}"; do for m in $model; do
  for policy in $POLICIES; do
    name=${policy/+/_}$TAG
    case $m in
      smol) for length in 4096 8192; do
              ruler_bg "smol_${name}_$length" "$out" --model /tmp/smol --samples-file /tmp/m/smol_ruler_4k8k.json.gz \
                --lengths $length --tasks all --samples 50 --dtype bfloat16 --sparse-min-context 0 \
                --num-gpu-blocks 1000 --policies "$policy" $EXTRA
            done ;;
      qwen) ruler_bg "qwen_$name" "$out" --model /tmp/qwen --samples-file /tmp/m/qwen_ruler_16k32k.json.gz \
              --lengths 16384 32768 --tasks $NIAH --samples 1000 --enable-cpu-offload --num-gpu-blocks 16 \
              --policies "$policy" $EXTRA ;;
      *) echo "unknown model $m (smol, qwen)" >&2; exit 1 ;;
    esac
  done
done; done
