"""Greedy tokens with CPU offload against GPU-only, on real text, in one process.

    PYTHONPATH=. python3 bench/offload_exactness.py --model DIR [--lengths 4096 8192] [--dtype float32 bfloat16]

For each dtype: a batch of excerpts of the package's source per length, GPU-only first, then with a device pool of
--gpu-blocks blocks (the rest of the KV on the host); both eager with 1,024-token chunks. Prints identical sequences and the first
divergence of the others with the logprob gap of the two candidate tokens there.
"""
from __future__ import annotations

import argparse
import gc

import torch

from common import HERE, log, save_results
from nanovllm import LLM, SamplingParams


def prompts(tokenizer, lengths: list[int], per_length: int) -> list[list[int]]:
    """Real text that needs no download: the package's own source, excerpts at different offsets."""
    source = sorted((HERE.parent / "nanovllm").glob("**/*.py"))
    essay = tokenizer("\n".join(p.read_text() for p in source)).input_ids
    return [essay[i * n // 3 : i * n // 3 + n - 64] for n in lengths for i in range(per_length)]


def run(model: str, batch: list[list[int]], dtype: str, max_tokens: int, **options) -> list:
    """Eager and small chunks in both modes: the same schedule, so the same arithmetic is expected."""
    llm = LLM(model, dtype=dtype, kvcache_block_size=256, enforce_eager=True, max_num_batched_tokens=1024, **options)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2), use_tqdm=False)
    stats = llm.runner.host_pool.stats if llm.runner.host_pool else None
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--per-length", type=int, default=4)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--gpu-blocks", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    batch = prompts(AutoTokenizer.from_pretrained(args.model), args.lengths, args.per_length)
    results = {}
    for dtype in args.dtype:
        want, _ = run(args.model, batch, dtype, args.max_tokens)
        got, stats = run(args.model, batch, dtype, args.max_tokens, num_gpu_blocks=args.gpu_blocks,
                         enable_cpu_offload=True, cpu_kv_cache_gb=4.0)
        same = sum(a.token_ids == b.token_ids for a, b in zip(want, got))
        gaps = []
        for a, b in zip(want, got):
            if a.token_ids != b.token_ids:
                i = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
                top = sorted(a.outputs[0].logprobs[i].values(), reverse=True)
                gaps.append({"position": i, "top2_logprob_gap": top[0] - top[1] if len(top) > 1 else None})
        results[dtype] = {"identical": same, "sequences": len(batch), "divergences": gaps,
                          "host_gib_read": stats.h2d_bytes / 2**30 if stats else 0}
        log(f"{dtype}: {same}/{len(batch)} identical; divergences {gaps}; {results[dtype]['host_gib_read']:.1f} GiB "
            "read from the host")
    save_results("offload_exactness", results)


if __name__ == "__main__":
    main()
