#!/usr/bin/env bash
# Issue #15: the measurements that made quest_key_copy="int8" Quest's default (twenty-ninth session), on the device machine
# (repo root there; `source bench/device/on_device.sh && wheels` first on a fresh machine):
#   gpu    GPU-only decode, 16 x 32K and 1 x 128K at budget 2048: pages by the bound, the default (rerank 2) and the
#          int8 copy, dense the peer (bench/sparse.py --key-copy-peer); JSON in $OUT, log /tmp/kc/gpu_only.log
#   prof   the copy's offload step at 1 x 128K, budget 2048, under the profiler (where its time goes); /tmp/kc/prof.log
#   smol   SmolLM2 4K / 8K RULER (13 tasks x 50), quest and xattention+quest through the copy, in the background
#          (needs /tmp/smol and /tmp/m/smol_ruler_4k8k.json.gz: on_device.sh's `assemble smol` and `keep`); collect
#          with `wait_runs` and `tables /tmp/kc`
# Usage: bash bench/device/key_copy_check.sh gpu|prof|smol...
set -euo pipefail
source "$(dirname "$0")/on_device.sh"
mkdir -p /tmp/kc
for step in "$@"; do
  case $step in
    gpu) (cd bench && python3 -u sparse.py --skip-prefill --skip-offload --gpu-only-cases 16x32768 1x131072 \
            --budgets 2048 --pages --rerank-peer 2 --key-copy-peer --decode-steps 16) 2>&1 | tee /tmp/kc/gpu_only.log ;;
    prof) (cd bench && python3 -u sparse.py --skip-prefill --skip-gpu-only --decode-cases 1x131072 --budgets 2048 \
             --key-copy-peer --profile-kernels --decode-steps 8) 2>&1 | tee /tmp/kc/prof.log ;;
    smol) POLICIES="quest xattention+quest" EXTRA="--quest-key-copy int8" TAG=_int8 \
            bash "$(dirname "$0")/sparse_table.sh" /tmp/kc smol ;;
    *) echo "unknown step $step (gpu, prof, smol)" >&2; exit 1 ;;
  esac
done
