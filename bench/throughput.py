"""Offline throughput on nano-vllm's workload, against HF transformers and the HBM floor, in one run.

Workload: N sequences (256), random prompt and output lengths uniform in [100, 1024], ignore_eos,
seed 0, on a Qwen3-0.6B-shaped model with random bf16 weights (bench/configs/qwen3-0.6b).
Floor: bytes that must cross HBM (weights once per decode step + each sequence's KV once per step)
over the copy bandwidth measured in this process.

    PYTHONPATH=. python3 bench/throughput.py [--num-seqs 256] [--hf-seqs 32 --hf-tokens 128] [--async-scheduling]
        [--gemv-rows 0] [--dependent-launch]
"""
from __future__ import annotations

import argparse
import random

import torch

from common import (HERE, add_dependent_launch_arg, hf_model, log, measure_hbm_bandwidth, require_cuda, save_results,
                    set_layer_ops, timed)
from nanovllm import LLM, SamplingParams


def workload(num_seqs: int, lo: int, hi: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    out_lens = [rng.randint(lo, hi) for _ in range(num_seqs)]
    return prompts, out_lens


def hbm_floor_seconds(llm: LLM, prompts, out_lens, bandwidth: float) -> float:
    """Lower bound if every sequence decodes concurrently: weights read once per step, KV once per token."""
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    layers, _, kv_heads, head_dim = llm.runner.kv_shape
    kv_per_token = 2 * layers * kv_heads * head_dim * llm.runner.kv_cache.data.element_size()
    steps = max(out_lens)
    kv_reads = sum(n * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, out_lens)) * kv_per_token
    return (weight_bytes * steps + kv_reads) / bandwidth


def run_ours(llm: LLM, prompts, out_lens) -> tuple[float, int]:
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=True))
    return seconds, sum(len(o.token_ids) for o in outs)


def run_hf(model, prompts, new_tokens: int) -> tuple[float, int]:
    """HF generate, left-padded batch, a fixed number of new tokens per sequence."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                  temperature=0.6, pad_token_id=0)
    out, seconds = timed(lambda: model.generate(ids, **kwargs))
    return seconds, (out.shape[1] - width) * len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "qwen3-0.6b"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--hf-seqs", type=int, default=32, help="HF runs this many of the prompts (0: skip HF)")
    ap.add_argument("--hf-tokens", type=int, default=128, help="new tokens per sequence in the HF comparison")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true", help="launch each step before the last one's tokens are on the host")
    ap.add_argument("--gemv-rows", type=int,
                    help="steps of at most this many rows run their narrow projections through the Triton GEMV "
                         "(TritonLayerOps.gemv_rows, default 1; 0: cuBLAS; the decode graphs recaptured)")
    add_dependent_launch_arg(ap)
    args = ap.parse_args()
    require_cuda()
    bandwidth = measure_hbm_bandwidth()
    log(f"HBM copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    llm = LLM(args.config, load_format="dummy", max_model_len=2 * args.max_len + 16, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling)
    set_layer_ops(llm, args.gemv_rows, args.dependent_launch)
    vocab = llm.config.hf_config["vocab_size"]
    prompts, out_lens = workload(args.num_seqs, args.min_len, args.max_len, vocab)
    # Warm-up on other prompts (no prefix-cache hits later) that, like the workload, mix chunked prefills
    # with decodes: Triton compiles those kernel variants here, not inside the timed run.
    warm_prompts, _ = workload(64, args.min_len, args.max_len, vocab, seed=1)
    llm.generate(warm_prompts, SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True), use_tqdm=False)
    seconds, tokens = run_ours(llm, prompts, out_lens)
    floor = hbm_floor_seconds(llm, prompts, out_lens, bandwidth)
    results = {"num_seqs": args.num_seqs, "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
               "hbm_floor_s": floor, "floor_tok_s": tokens / floor, "fraction_of_floor": floor / seconds,
               "backend": llm.runner.backend.name, "cuda_graphs": llm.runner.graphs is not None,
               "async_scheduling": args.async_scheduling, "gemv_rows": llm.runner.layer_ops.gemv_rows,
               "dependent_launch": llm.runner.layer_ops.dependent_launch}
    log(f"nanovllm: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s; "
        f"HBM floor {floor:.2f} s ({tokens / floor:,.0f} tok/s): {100 * floor / seconds:.1f}% of the floor")
    if args.hf_seqs:
        subset = prompts[: args.hf_seqs]
        ours_s, ours_t = run_ours(llm, subset, [args.hf_tokens] * len(subset))
        del llm
        torch.cuda.empty_cache()
        model = hf_model(args.config)
        run_hf(model, subset[:2], 4)  # warm-up
        hf_s, hf_t = run_hf(model, subset, args.hf_tokens)
        results.update(hf_seqs=len(subset), hf_tokens_each=args.hf_tokens, hf_tok_s=hf_t / hf_s,
                       ours_same_subset_tok_s=ours_t / ours_s, speedup_vs_hf_same_subset=(ours_t / ours_s) / (hf_t / hf_s),
                       speedup_full_workload_vs_hf=(tokens / seconds) / (hf_t / hf_s))
        log(f"HF transformers on {len(subset)} prompts x {args.hf_tokens} tokens: {hf_t / hf_s:,.0f} tok/s; "
            f"nanovllm on the same subset {ours_t / ours_s:,.0f} tok/s = {results['speedup_vs_hf_same_subset']:.1f}x; "
            f"full workload vs HF {results['speedup_full_workload_vs_hf']:.1f}x")
    save_results("throughput", results)


if __name__ == "__main__":
    main()
