#!/usr/bin/env bash
# A burst of 500 requests against the tree OLD (the pool for every request) and this one (small bodies prepared on
# the event loop), alternating; bench/burst.py's client. CPU: the 1-layer config of front_end_stack.sh (DIR/tiny).
# Usage (repo root, venv active): bash docs/results/thirtyseventh/burst_ab.sh OLD DIR [PAIRS]
set -euo pipefail
old=$(realpath "$1"); dir=$2; pairs=${3:-2}; here=$PWD
[ -f "$dir/tiny/config.json" ] || { echo "run front_end_stack.sh $dir first (it writes $dir/tiny)" >&2; exit 2; }
port=8197
serve() {  # TREE: a server of that tree's package on $port until killed
  (cd "$1" && PYTHONPATH=$1 python3 -m nanovllm.cli serve "$dir/tiny" --load-format dummy --device cpu \
    --dtype float32 --max-model-len 512 --num-gpu-blocks 8192 --kvcache-block-size 16 --max-num-seqs 256 \
    --port $port --max-pending-requests 4096 > "$dir/burst_server.log" 2>&1) &
  for _ in $(seq 120); do curl -sf localhost:$port/health > /dev/null && return; sleep 1; done
  echo "the server did not start" >&2; exit 1
}
for i in $(seq "$pairs"); do
  for tree in "$old" "$here"; do
    serve "$tree"
    echo "== $([ "$tree" = "$here" ] && echo new || echo old), pair $i"
    python3 bench/burst.py --url http://127.0.0.1:$port --requests 500 --bursts 3
    pkill -f "serve $dir/tiny" || true; sleep 3
  done
done
