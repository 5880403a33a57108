"""Tensor parallelism: TP=1 against TP=N on the same random weights (load_format=dummy draws the one-rank
model's weights and cuts them per rank): greedy agreement, batch-1 decode ms per token against the HBM
floor of one rank's share (weights / N + KV / N over the measured copy bandwidth), and throughput.

    PYTHONPATH=. python3 bench/tensor_parallel.py --tp 1 2 [--model bench/configs/llama-3.1-8b] \
        [--out docs/results/tensor_parallel/h200.json]
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


def floor_ms(llm: LLM, context: int, bandwidth: float | None) -> float | None:
    """One rank's bytes per decode step (its weights and its KV heads' share of the context) over HBM bandwidth."""
    if bandwidth is None:
        return None
    weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    kv = llm.runner.bytes_per_block * context / llm.config.kvcache_block_size
    return 1e3 * (weights + kv) / bandwidth


def run(model: str, tp: int, options: dict, args, bandwidth: float | None) -> dict:
    with LLM(model, tensor_parallel_size=tp, load_format="dummy", **options) as llm:
        vocab = llm.config.hf_config["vocab_size"]
        greedy(llm, prompts(vocab, 2, 16, 0), 4)  # warm-up
        tokens = greedy(llm, prompts(vocab, args.agreement_prompts, args.agreement_len, 1), args.agreement_tokens)
        ms = decode_ms(llm, args.context, args.decode_tokens)
        tok_s = throughput(llm, args.requests, args.input_len, args.output_len)
        floor = floor_ms(llm, args.context, bandwidth)
    row = {"tp": tp, "decode_ms_per_token": round(ms, 3), "throughput_tok_s": round(tok_s, 1),
           "decode_floor_ms": None if floor is None else round(floor, 3),
           "decode_vs_floor": None if floor is None else round(ms / floor, 3)}
    log(f"TP={tp}: batch-1 decode {ms:.3f} ms/token (floor {row['decode_floor_ms']}), "
        f"throughput {tok_s:.1f} output tok/s")
    return row | {"tokens": tokens}


def agreement(rows: list[dict]) -> None:
    """Greedy tokens of every TP size against the first: identical sequences and first divergence."""
    ref = rows[0]["tokens"]
    for row in rows:
        toks = row.pop("tokens")
        same = sum(a == b for a, b in zip(toks, ref))
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(toks, ref)]
        row["greedy_identical"] = f"{same}/{len(ref)}"
        row["first_divergence"] = [f for f in firsts if f is not None]
        log(f"TP={row['tp']}: greedy identical to TP={rows[0]['tp']} for {same}/{len(ref)} prompts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE / "configs" / "llama-3.1-8b"), help="a directory with config.json")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cpu", action="store_true", help="a tiny Llama on the CPU (gloo): checks that it runs")
    parser.add_argument("--context", type=int, default=8192, help="batch-1 decode context")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--agreement-prompts", type=int, default=16)
    parser.add_argument("--agreement-len", type=int, default=256)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.cpu:
        tmp = Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(json.dumps(TINY))
        model, options, bandwidth = str(tmp), dict(device="cpu", dtype="float32", kvcache_block_size=16), None
        args.context, args.decode_tokens, args.requests, args.input_len, args.output_len = 256, 16, 8, 32, 16
        args.agreement_prompts, args.agreement_len, args.agreement_tokens = 4, 32, 8
    else:
        from common import measure_hbm_bandwidth, require_cuda

        require_cuda()
        model, options, bandwidth = args.model, {}, measure_hbm_bandwidth()
        log(f"HBM copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = [run(model, tp, options, args, bandwidth) for tp in args.tp]
    agreement(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": model, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
