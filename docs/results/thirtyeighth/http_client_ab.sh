#!/usr/bin/env bash
# bench serving's client on aiohttp (the new default) and httpx alternating, CPU only: the 1-layer width-64 config
# of thirtyseventh/front_end_stack.sh (cheap engine steps), 500 x 64 in / 64 out at rate inf, 2 client processes.
# Usage (repo root, venv active): bash docs/results/thirtyeighth/http_client_ab.sh OUTDIR [PAIRS]
set -euo pipefail
out=$1; pairs=${2:-2}
mkdir -p "$out/tiny"
python - "$out/tiny" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from host_step import TINY
json.dump({**TINY, "vocab_size": 2048}, open(f"{sys.argv[1]}/config.json", "w"))
PY
for i in $(seq "$pairs"); do
  for client in httpx aiohttp; do
    nanovllm bench serving --model "$out/tiny" --load-format dummy --device cpu --dtype float32 --max-model-len 512 \
      --num-gpu-blocks 4096 --kvcache-block-size 16 --vocab-size 2048 --max-num-seqs 256 --request-rates inf \
      --num-prompts 500 --input-len 64 --output-len 64 --no-offline --client-processes 2 --api-server-count 2 \
      --http-client $client --output-dir "$out" --name "serving_${client}_$i" > /dev/null 2>&1
    python - "$out/serving_${client}_$i.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rates"][0]
cpu = r["client_cpu_busy"] * r["duration_s"] * r["client_processes"]
print(f"{r['http_client']:>8}: {r['output_throughput_tok_s']:6.0f} tok/s, run {r['duration_s']:.2f} s, TTFT p50 "
      f"{1e3 * r['ttft_s']['p50']:.0f} ms; client {1e6 * cpu / r['output_tokens']:.0f} CPU us/token (busy "
      f"{r['client_cpu_busy']:.2f}); engine busy by tenths {' '.join(f'{b:.2f}' for b in r['engine_busy_by_tenth'])}")
PY
  done
done
