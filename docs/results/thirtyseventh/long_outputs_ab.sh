#!/usr/bin/env bash
# The front end's CPU per streamed token at long outputs: the tree OLD (a copy of each request's token list per
# step) and this one (`server/prefix.Prefix`), alternating. CPU: a tiny config whose positions reach 16K.
# Usage (repo root, venv active): bash docs/results/thirtyseventh/long_outputs_ab.sh OLD OUTDIR [OUTPUT_LEN] [PROMPTS]
set -euo pipefail
old=$(realpath "$1"); out=$2; len=${3:-8192}; n=${4:-8}; here=$PWD
mkdir -p "$out/tinylong"
python - "$out/tinylong" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from host_step import TINY
json.dump({**TINY, "vocab_size": 2048, "max_position_embeddings": 16384}, open(f"{sys.argv[1]}/config.json", "w"))
PY
for pair in 1 2; do
  for tree in "$old" "$here"; do
    name=$([ "$tree" = "$here" ] && echo new || echo old)_$pair
    (cd "$tree" && PYTHONPATH=$tree python3 -m nanovllm.cli bench serving --model "$out/tinylong" --load-format dummy \
      --device cpu --dtype float32 --max-model-len $((len + 128)) --num-gpu-blocks 8192 --kvcache-block-size 16 \
      --vocab-size 2048 --max-num-seqs "$n" --request-rates inf --num-prompts "$n" --input-len 64 --output-len "$len" \
      --no-offline --output-dir "$out" --name "long_$name") > /dev/null 2>&1
    python - "$out/long_$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rates"][0]
cpu = r["server_cpu_busy"] * r["duration_s"]
print(f"{sys.argv[2]:>6}: front end {cpu:.2f} CPU s for {r['output_tokens']} tokens = {1e6 * cpu / r['output_tokens']:.1f} "
      f"us/token in {r['duration_s']:.1f} s ({r['output_throughput_tok_s']:.0f} tok/s)")
PY
  done
done
