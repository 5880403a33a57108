#!/usr/bin/env bash
# The front end's CPU per streamed token, old stack (asyncio + h11) and new default (uvloop + httptools)
# alternating. CPU only: a 1-layer Qwen3 config of width 64 and a 2,048-token vocabulary (random weights), so
# that the engine's step is cheap; the front end's CPU seconds come from /proc over the run.
# Usage (repo root, venv active): bash docs/results/thirtyseventh/front_end_stack.sh OUTDIR [PAIRS]
set -euo pipefail
out=$1; pairs=${2:-3}
mkdir -p "$out/tiny"
python - "$out/tiny" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from host_step import TINY
json.dump({**TINY, "vocab_size": 2048}, open(f"{sys.argv[1]}/config.json", "w"))
PY
for i in $(seq "$pairs"); do
  for stack in "asyncio h11" "auto auto"; do
    set -- $stack
    nanovllm bench serving --model "$out/tiny" --load-format dummy --device cpu --dtype float32 --max-model-len 512 \
      --num-gpu-blocks 4096 --kvcache-block-size 16 --vocab-size 2048 --max-num-seqs 256 --request-rates inf \
      --num-prompts 500 --input-len 64 --output-len 64 --no-offline --client-processes 2 \
      --uvicorn-loop "$1" --uvicorn-http "$2" --output-dir "$out" --name "serving_${1}_${2}_$i" > /dev/null 2>&1
    python - "$out/serving_${1}_${2}_$i.json" "$1 $2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rates"][0]
cpu = r["server_cpu_busy"] * r["duration_s"]
print(f"{sys.argv[2]:>13}: front end {cpu:.2f} CPU s for {r['output_tokens']} tokens = {1e6 * cpu / r['output_tokens']:.1f} "
      f"us/token; {r['output_throughput_tok_s']:.0f} tok/s, client busy {r['client_cpu_busy']:.2f}")
PY
  done
done
