"""Greedy agreement with float32 under batching: N long prompts generated together (as RULER runs them) in
bf16 with the default chunk budget, with small chunks, in offload mode, and one at a time unchunked.
Prints, per mode, how many outputs equal the float32 batch's token for token and the mean length of
the agreeing prefix: if batching or offload cost accuracy systematically, those modes agree less.

    PYTHONPATH=. python3 bench/batch_agreement.py MODEL_DIR [--prompts 8] [--length 16384] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from precision_probe import HERE, prompt_tokens, same_prefix


def generate(model: str, prompts: list[list[int]], new_tokens: int, one_at_a_time: bool = False,
             **options) -> list[list[int]]:
    llm = LLM(model, max_model_len=max(map(len, prompts)) + new_tokens + 1, enforce_eager=True,
              enable_prefix_caching=False, **options)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    outputs = [o.token_ids for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--offload-blocks", type=int, default=16)
    args = ap.parse_args()
    text = prompt_tokens(args.model, args.length * 2)
    step = args.length // args.prompts
    prompts = [text[i * step : i * step + args.length - 8 * i] for i in range(args.prompts)]  # unequal lengths
    reference = generate(args.model, prompts, args.new_tokens, dtype="float32")
    modes = {"bf16 batch, chunks of 8192": dict(),
             "bf16 batch, chunks of 2048": dict(max_num_batched_tokens=2048),
             "bf16 batch, offload": dict(enable_cpu_offload=True, num_gpu_blocks=args.offload_blocks, cpu_kv_cache_gb=8.0),
             "bf16 one at a time, unchunked": dict(max_num_batched_tokens=args.length, one_at_a_time=True)}
    rows = []
    for name, options in modes.items():
        got = generate(args.model, prompts, args.new_tokens, dtype="bfloat16", **options)
        agree = [same_prefix(g, r) for g, r in zip(got, reference)]
        identical = sum(a == args.new_tokens for a in agree)
        print(f"{name:32s} identical to fp32: {identical}/{len(prompts)}; agreeing prefix mean "
              f"{sum(agree) / len(agree):5.1f} of {args.new_tokens}: {agree}", flush=True)
        rows.append({"mode": name, "identical": identical, "agreeing_prefix": agree})
    out = Path(os.environ.get("OUT") or HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_agreement.json").write_text(json.dumps({"length": args.length, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
