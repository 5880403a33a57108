#!/usr/bin/env bash
# The speed regression set of a refactor, for a before/after pair on one machine (H200):
# the throughput workload, batch-1 decode at 1K and 32K, offload decode 1x64K (graphs) and 4x32K,
# offload prefill 4x32K against GPU-only. Run it for the old tree and the new one in the same session:
#   git archive <old commit> nanovllm bench pyproject.toml | tar -x -C .before
#   bench/regression.sh .before before; bench/regression.sh . after
# JSON and logs land in $OUT/<label> (else bench/results/<label>). SKIP_OFFLOAD=1: the first two only.
set -uo pipefail
tree=$(realpath "${1:-.}")
label=${2:-after}
out=${OUT:-$tree/bench/results}/$label
mkdir -p "$out"
export PYTHONPATH=$tree PYTHONUNBUFFERED=1 OUT=$out
cd "$tree/bench"
python3 throughput.py --hf-seqs 0 2>&1 | tee "$out/throughput.log"
python3 latency.py --cases 1x1024 1x32768 --prefill-contexts 32768 --skip-hf 2>&1 | tee "$out/latency.log"
[ "${SKIP_OFFLOAD:-0}" = 1 ] || python3 offload.py --cases 1x65536 4x32768 --skip-hf 2>&1 | tee "$out/offload.log"
