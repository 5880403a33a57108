"""Latency on a Llama-3.1-8B-shaped model (random bf16 weights) against the HBM floor and HF transformers.

For batch 1 at 1K and 32K tokens and batch 32 at 1K (batch 32 at 32K needs 128 GiB of KV, more than
the card holds beside the weights): time to first token, and ms per output token
against the floor (weights + every sequence's KV read once per step, over the measured copy
bandwidth). Prefill tokens/s at 8K and 32K against HF transformers' forward in the same process.

    PYTHONPATH=. python3 bench/latency.py [--cases 1x1024 1x32768 32x1024] [--prefill-contexts 8192 32768]
        [--decode-tokens 64] [--skip-hf] [--sparse-policy full|xattention|quest|xattention+quest] [--async-scheduling]
        [--gemv-rows 0] [--dependent-launch]
"""
from __future__ import annotations

import argparse
import time

import torch

from common import (HERE, add_dependent_launch_arg, hf_model, log, measure_hbm_bandwidth, require_cuda, save_results,
                    set_layer_ops, timed)
from nanovllm import LLM, SamplingParams
from nanovllm.kernels.compile_watch import WATCH


def decode_floor_ms(llm: LLM, batch: int, context: int, bandwidth: float) -> float:
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    layers, _, kv_heads, head_dim = llm.runner.kv_shape
    kv_bytes = 2 * layers * kv_heads * head_dim * 2 * context * batch
    return 1e3 * (weight_bytes + kv_bytes) / bandwidth


def measure_decode(llm: LLM, batch: int, context: int, new_tokens: int, run: int = 0) -> tuple[float, float]:
    """Returns (time to first token in s, ms per output token) for a batch of equal-length prompts.
    TTFT: until every prompt has its first token; ms per token: decode steps after that only, so a
    batch whose prompts are prefilled in several chunks does not count prefill steps as decode.
    Each run gets prompts of its own (no prefix-cache hit on an earlier run's)."""
    g = torch.Generator().manual_seed(batch * 7 + context + 1_000_003 * run)
    vocab = llm.config.hf_config["vocab_size"]
    prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    seqs = [llm.requests[llm.add_request(p, params)].seq for p in prompts]
    while any(s.first_token_time is None for s in seqs):  # a real token (async scheduling appends placeholders)
        llm.step()
    first_all = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
    torch.cuda.synchronize()
    return first_all - start, 1e3 * (time.perf_counter() - first_all) / (new_tokens - 1)

def prefill_tok_s(llm: LLM, context: int) -> float:
    prompt = torch.randint(0, llm.config.hf_config["vocab_size"], (context,)).tolist()
    _, seconds = timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False))
    return context / seconds


def hf_prefill_tok_s(model, context: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    with torch.no_grad():
        model(ids[:, :512], logits_to_keep=1)  # warm-up
        _, seconds = timed(lambda: model(ids, logits_to_keep=1))
    return context / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "llama-3.1-8b"))
    ap.add_argument("--cases", nargs="+", default=["1x1024", "1x32768", "32x1024"], help="BATCHxCONTEXT")
    ap.add_argument("--prefill-contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--sparse-policy", default="full",
                    help="the engine's sparse_policy (below sparse_min_context, 8192 by default, it must cost nothing)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the engine's async_scheduling: each step's host work while the GPU runs the previous one")
    ap.add_argument("--gemv-rows", type=int,
                    help="steps of at most this many rows run their narrow projections through the Triton GEMV "
                         "(TritonLayerOps.gemv_rows, default 1; 0: cuBLAS; the decode graphs recaptured)")
    add_dependent_launch_arg(ap)
    args = ap.parse_args()
    require_cuda()
    bandwidth = measure_hbm_bandwidth()
    log(f"HBM copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases]
    results = {"decode": [], "prefill": [dict(context=c) for c in args.prefill_contexts]}
    if not args.skip_hf:  # HF first, then free it for our engine's KV pool
        model = hf_model(args.config)
        for row in results["prefill"]:
            row["hf_tok_s"] = hf_prefill_tok_s(model, row["context"])
            log(f"HF prefill {row['context']} tokens: {row['hf_tok_s']:,.0f} tok/s")
        del model
        torch.cuda.empty_cache()
    max_len = max([c for _, c in cases] + args.prefill_contexts) + args.decode_tokens + 16
    llm = LLM(args.config, load_format="dummy", max_model_len=max_len, max_num_seqs=max(b for b, _ in cases),
              sparse_policy=args.sparse_policy, async_scheduling=args.async_scheduling)
    results["sparse_policy"] = args.sparse_policy
    results["async_scheduling"] = args.async_scheduling
    set_layer_ops(llm, args.gemv_rows, args.dependent_launch)
    results["gemv_rows"] = llm.runner.layer_ops.gemv_rows
    results["dependent_launch"] = llm.runner.layer_ops.dependent_launch
    results["startup_s"] = llm.startup_seconds
    log(f"engine start-up (weights, KV pool, warm-up, kernels, CUDA graphs): {llm.startup_seconds:.1f} s")
    llm.generate([[1] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    for batch, context in cases:
        compiled_before = len(WATCH.request_path_events())
        short = min(context, 2048)
        cold_ttft, _ = measure_decode(llm, batch, short, 4, run=1)  # first run of a new batch size
        warm_ttft, _ = measure_decode(llm, batch, short, 4, run=2)  # the same shapes again, other prompts
        ttft, tpot = measure_decode(llm, batch, context, args.decode_tokens)
        floor = decode_floor_ms(llm, batch, context, bandwidth)
        compiled = [e.kernel for e in WATCH.request_path_events()[compiled_before:]]
        results["decode"].append(dict(batch=batch, context=context, ttft_s=ttft, cold_ttft_2k_s=cold_ttft,
                                      warm_ttft_2k_s=warm_ttft,
                                      compiled_on_request_path=compiled, ms_per_token=tpot,
                                      floor_ms=floor, ratio_to_floor=tpot / floor))
        log(f"batch {batch:3d} context {context:6d}: TTFT {ttft * 1e3:8.1f} ms (<=2K context: first run of this "
            f"batch size {cold_ttft * 1e3:.1f} ms, second {warm_ttft * 1e3:.1f} ms -> {cold_ttft / warm_ttft:.2f}x), "
            f"{tpot:6.2f} ms/token, "
            f"floor {floor:5.2f} ms -> {tpot / floor:.2f}x the floor; "
            f"Triton variants compiled on the request path: {len(compiled)} {sorted(set(compiled))}")
    for row in results["prefill"]:
        row["tok_s"] = prefill_tok_s(llm, row["context"])
        if "hf_tok_s" in row:
            row["speedup_vs_hf"] = row["tok_s"] / row["hf_tok_s"]
    for row in results["prefill"]:
        hf = f", HF {row['hf_tok_s']:,.0f} tok/s -> {row['speedup_vs_hf']:.2f}x" if "hf_tok_s" in row else ""
        log(f"prefill {row['context']:6d} tokens: {row['tok_s']:,.0f} tok/s{hf}")
    save_results("latency", results)


if __name__ == "__main__":
    main()
