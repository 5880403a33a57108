#!/usr/bin/env bash
# A burst of 500 requests at once (bench/burst.py: raw sockets, 64 token ids, 1 token each) against a server of the
# tiny config (one front end), the tree OLD and this one alternating: how soon the first tokens come back.
# Usage (repo root, venv active): bash docs/results/thirtyeighth/burst_ab.sh OLD MODEL_DIR [PAIRS]
set -uo pipefail
old=$(realpath "$1"); model=$2; pairs=${3:-2}; here=$PWD
ulimit -n 8192
for pair in $(seq "$pairs"); do
  for tree in "$old" "$here"; do
    pkill -f "serve $model" ; sleep 2
    (cd "$tree" && PYTHONPATH=$tree nohup python3 -m nanovllm.cli serve "$model" --load-format dummy --device cpu \
      --dtype float32 --max-model-len 512 --num-gpu-blocks 8192 --kvcache-block-size 16 --max-num-seqs 256 \
      --port 8199 --served-model-name tiny --max-pending-requests 4096 > /tmp/burst_srv.log 2>&1 &)
    for i in $(seq 90); do curl -s localhost:8199/health > /dev/null && break; sleep 1; done
    echo "== $([ "$tree" = "$here" ] && echo new || echo old) $pair"
    python3 bench/burst.py --url http://127.0.0.1:8199 --requests 500 --bursts 4 --prompt-len 64 --max-tokens 1 \
      2>&1 | tail -4
  done
done
pkill -f "serve $model"
