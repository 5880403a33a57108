"""Tensor parallelism: TP=1 against TP=N on the same weights (random by default: load_format=dummy draws the
one-rank model's weights and cuts them per rank; --real-weights loads --model's files): greedy agreement (where
a TP size's tokens diverge from the first's, the gap between the two most likely tokens' logprobs there: a
near-tie or not), batch-1 decode ms per token at each of --contexts against the HBM floor of one rank's share
(weights / N + KV / N over the measured copy bandwidth), throughput, and with --offload-context batch-1 decode
with the KV offloaded, each rank a 24 GB card's device pool (bench/offload.py's budget), against the floor of
rank 0's host-to-device bytes per step over its own PCIe link.

    PYTHONPATH=. python3 bench/tensor_parallel.py --tp 1 2 [--model bench/configs/llama-3.1-8b] \
        [--contexts 1024 32768] [--offload-context 131072] [--out docs/results/tensor_parallel/h200.json]
    PYTHONPATH=. python3 bench/tensor_parallel.py --tp 1 2 --model /tmp/smol --real-weights --dtype float32 \
        --skip-throughput                                              # SmolLM2's own weights in fp32
    PYTHONPATH=. python3 bench/tensor_parallel.py --cpu --tp 1 2     # a tiny model on the CPU (gloo), a smoke run

One engine at a time (one tensor-parallel group per process); each is shut down before the next starts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, log  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6}


def sync(llm: LLM) -> None:
    if llm.runner.device.type == "cuda":
        torch.cuda.synchronize()


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


def greedy(llm: LLM, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def greedy_with_gaps(llm: LLM, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and, at each, the gap between the two largest logprobs of its step (0: a tie)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(batch, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[top_two_gap(step) for step in o.outputs[0].logprobs] for o in outs]


def top_two_gap(logprobs: dict[int, float]) -> float:
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


def decode_ms(llm: LLM, context: int, new_tokens: int) -> float:
    """ms per output token of one sequence, decode steps only."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    seq = llm.requests[llm.add_request(prompts(llm.config.hf_config["vocab_size"], 1, context, 7)[0], params)].seq
    while seq.num_output_tokens == 0:
        llm.step()
    sync(llm)
    start, steps = time.perf_counter(), 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
    sync(llm)
    return 1e3 * (time.perf_counter() - start) / steps


def throughput(llm: LLM, count: int, in_len: int, out_len: int) -> float:
    """Output tokens per second of `count` requests submitted at once."""
    batch = prompts(llm.config.hf_config["vocab_size"], count, in_len, 11)
    sync(llm)
    start = time.perf_counter()
    greedy(llm, batch, out_len)
    sync(llm)
    return count * out_len / (time.perf_counter() - start)


def against_floor(floor: float | None, ms: float) -> str:
    """ "floor F ms, R x" for a log line; "no floor" where none applies (the CPU)."""
    return "no floor" if not floor else f"floor {floor:.3f} ms, {ms / floor:.3f}x"


def floor_ms(llm: LLM, context: int, bandwidth: float | None) -> float | None:
    """One rank's bytes per decode step (its weights and its KV heads' share of the context) over HBM bandwidth."""
    if bandwidth is None:
        return None
    weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    kv = llm.runner.bytes_per_block * context / llm.config.kvcache_block_size
    return 1e3 * (weights + kv) / bandwidth


def run(model: str, tp: int, options: dict, args, bandwidth: float | None) -> dict:
    with LLM(model, tensor_parallel_size=tp, **options) as llm:
        vocab = llm.config.hf_config["vocab_size"]
        greedy(llm, prompts(vocab, 2, 16, 0), 4)  # warm-up
        tokens, gaps = greedy_with_gaps(llm, prompts(vocab, args.agreement_prompts, args.agreement_len, 1),
                                        args.agreement_tokens)
        decode = []
        for context in args.contexts:
            ms, floor = decode_ms(llm, context, args.decode_tokens), floor_ms(llm, context, bandwidth)
            decode.append({"context": context, "ms_per_token": round(ms, 3),
                           "floor_ms": None if floor is None else round(floor, 3),
                           "vs_floor": None if floor is None else round(ms / floor, 3)})
            log(f"TP={tp}: batch-1 decode at {context}: {ms:.3f} ms/token ({against_floor(floor, ms)})")
        tok_s = None if args.skip_throughput else throughput(llm, args.requests, args.input_len, args.output_len)
    if tok_s is not None:
        log(f"TP={tp}: throughput {tok_s:.1f} output tok/s")
    return {"tp": tp, "decode": decode, "throughput_tok_s": None if tok_s is None else round(tok_s, 1),
            "tokens": tokens, "gaps": gaps}


def agreement(rows: list[dict]) -> None:
    """Greedy tokens of every TP size against the first: identical sequences, and where one diverges, the first
    token and the top-two logprob gap there in both runs (a divergence at a near-tie is rounding, not a bug)."""
    ref, ref_gaps = rows[0]["tokens"], rows[0]["gaps"]
    ref_key = f"top2_gap_tp{rows[0]['tp']}"
    for row in rows:
        toks, gaps = row.pop("tokens"), row.pop("gaps")
        row["divergences"] = []
        for p, (a, b) in enumerate(zip(toks, ref)):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is not None:
                row["divergences"].append({"prompt": p, "token": i, "top2_gap": round(gaps[p][i], 4),
                                           ref_key: round(ref_gaps[p][i], 4)})
        same = len(ref) - len(row["divergences"])
        row["greedy_identical"] = f"{same}/{len(ref)}"
        where = ", ".join(f"prompt {d['prompt']} at token {d['token']} (top-2 gap {d['top2_gap']:.4f} here, "
                          f"{d[ref_key]:.4f} at TP={rows[0]['tp']})" for d in row["divergences"])
        log(f"TP={row['tp']}: greedy identical to TP={rows[0]['tp']} for {same}/{len(ref)} prompts"
            + (f"; diverging: {where}" if where else ""))


def offload_decode(model: str, tp: int, options: dict, context: int, steps: int, h2d: float | None,
                   device_blocks: int | None = None) -> dict:
    """Batch-1 decode over `context` tokens with the KV offloaded, each rank's device pool what a 24 GB card leaves
    beside its weights' share (bench/offload.py's budget; device_blocks overrides it), the rest of its KV heads'
    blocks in pinned host memory: ms per step against rank 0's host-to-device bytes per step over the pinned copy
    bandwidth h2d (each rank copies its own heads' blocks over its own link; None: no floor)."""
    from offload import ACTIVATION_GIB, CARD_GIB, random_prompts

    with LLM(model, tensor_parallel_size=tp, num_gpu_blocks=1, enforce_eager=True, **options) as probe:
        weights = sum(p.numel() * p.element_size() for p in probe.runner.model.parameters())
        block_bytes, block_size = probe.runner.bytes_per_block, probe.config.kvcache_block_size
        vocab, max_len = probe.config.hf_config["vocab_size"], probe.config.max_model_len
    context = min(context, max_len - steps - 2 * block_size)
    if device_blocks is None:
        device_blocks = int((CARD_GIB - weights / 2**30 - ACTIVATION_GIB) * 2**30 // block_bytes)
    host_blocks = max(8, -(-(context + steps + 8) // block_size) - device_blocks + 8)
    with LLM(model, tensor_parallel_size=tp, num_gpu_blocks=device_blocks, enable_cpu_offload=True,
             cpu_kv_cache_gb=host_blocks * block_bytes * tp / 2**30, **options) as llm:  # the ranks' pools together
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        request = llm.add_request(random_prompts(vocab, 1, context, 5)[0], params)
        while llm.requests[request].seq.num_output_tokens == 0:
            llm.step()
        for _ in range(2):  # untimed: the first steps of a new shape
            llm.step()
        stats = llm.runner.host_pool.stats
        copied = stats.h2d_bytes
        sync(llm)
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync(llm)
        ms = 1e3 * (time.perf_counter() - start) / steps
        per_step = (stats.h2d_bytes - copied) / steps
        llm.abort_request(request)
    floor = None if h2d is None else 1e3 * per_step / h2d
    row = {"tp": tp, "context": context, "device_blocks": device_blocks, "ms_per_step": round(ms, 2),
           "host_mb_per_step_rank0": round(per_step / 1e6, 2), "pcie_floor_ms": floor and round(floor, 2),
           "vs_floor": round(ms / floor, 3) if floor else None}
    log(f"TP={tp}: offload decode 1 x {context}: {row['ms_per_step']} ms/step, rank 0 copies "
        f"{row['host_mb_per_step_rank0']} MB/step ({against_floor(floor, ms)})")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE / "configs" / "llama-3.1-8b"), help="a directory with config.json")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cpu", action="store_true", help="a tiny Llama on the CPU (gloo): checks that it runs")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768], help="batch-1 decode contexts")
    parser.add_argument("--offload-context", type=int, default=0,
                        help="batch-1 decode with the KV offloaded at this context (0: not run)")
    parser.add_argument("--offload-steps", type=int, default=16)
    parser.add_argument("--real-weights", action="store_true", help="load --model's weights (default: random)")
    parser.add_argument("--dtype", default=None, help="the engines' dtype (default: the model's)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--agreement-prompts", type=int, default=16)
    parser.add_argument("--agreement-len", type=int, default=256)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    options = dict(load_format="auto" if args.real_weights else "dummy") | ({"dtype": args.dtype} if args.dtype else {})
    if args.cpu:
        tmp = Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(json.dumps(TINY))
        model, bandwidth = str(tmp), None
        options.update(device="cpu", dtype="float32", kvcache_block_size=16, load_format="dummy")
        args.contexts, args.decode_tokens, args.requests, args.input_len, args.output_len = [256], 16, 8, 32, 16
        args.agreement_prompts, args.agreement_len, args.agreement_tokens = 4, 32, 8
        args.offload_context, args.offload_steps = args.offload_context and 256, 8  # a pool of 4 blocks of 16
    else:
        from common import measure_hbm_bandwidth, require_cuda

        require_cuda()
        model, bandwidth = args.model, measure_hbm_bandwidth()
        log(f"HBM copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = [run(model, tp, options, args, bandwidth) for tp in args.tp]
    agreement(rows)
    offload_rows = []
    if args.offload_context:
        h2d, device_blocks = None, 4 if args.cpu else None
        if not args.cpu:
            from offload import measure_h2d_bandwidth

            h2d = measure_h2d_bandwidth()
            log(f"pinned host->device bandwidth {h2d / 1e9:.1f} GB/s")
        offload_rows = [offload_decode(model, tp, options, args.offload_context, args.offload_steps, h2d,
                                       device_blocks) for tp in args.tp]
        for row in offload_rows[1:]:
            row["speedup_vs_first"] = round(offload_rows[0]["ms_per_step"] / row["ms_per_step"], 3)
            log(f"TP={row['tp']}: offload decode {row['speedup_vs_first']}x TP={offload_rows[0]['tp']}")
    for row in rows[1:]:
        for mine, first in zip(row["decode"], rows[0]["decode"]):
            mine["speedup_vs_first"] = round(first["ms_per_token"] / mine["ms_per_token"], 3)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": model, "args": vars(args), "rows": rows,
                                              "offload": offload_rows}, indent=1))


if __name__ == "__main__":
    main()
