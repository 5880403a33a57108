"""Sweep the paged decode kernel's launch parameters on decode shapes of the benchmarks; print the
achieved bandwidth (KV bytes read / kernel time) as a fraction of the measured HBM copy bandwidth. Times are
of calls replayed in a CUDA graph, as the engine's decode graphs run them (back-to-back launches would time
Triton's host launcher at batch 1, where the kernel takes a few microseconds).

    PYTHONPATH=. python3 bench/tune_decode.py [--quick] [--shapes b1 b32] [--block-n 64 128] [--splits 1 16 64]
"""
from __future__ import annotations

import argparse
import itertools
import random

import torch

from common import graph_ms, log, measure_hbm_bandwidth, require_cuda, save_results
from nanovllm.kernels import triton_paged_attention as ops

# (name, batch, context lengths lo..hi, query heads, KV heads, the bench's max_model_len); head_dim 128, bf16,
# 256-token blocks. The block tables are as wide as max_model_len, as in the engine's decode graphs, so the default
# launch ("engine") is the one the engine runs for that bench (its splits follow the tables' width).
SHAPES = [
    ("qwen3-0.6b throughput", 256, (100, 1100), 16, 8, 2 * 1024 + 16),  # throughput.py
    ("qwen3-0.6b throughput b113", 113, (700, 1700), 16, 8, 2 * 1024 + 16),  # its batch at step ~600
    ("qwen3-0.6b throughput b64", 64, (800, 1800), 16, 8, 2 * 1024 + 16),  # its tail: one split from 30 rows
    ("qwen3-0.6b throughput b48", 48, (900, 1900), 16, 8, 2 * 1024 + 16),
    ("qwen3-0.6b throughput b30", 30, (1000, 2000), 16, 8, 2 * 1024 + 16),
    ("qwen3-0.6b throughput b20", 20, (1100, 2000), 16, 8, 2 * 1024 + 16),
    ("llama-8b b1 1K", 1, (1024, 1024), 32, 8, 32768 + 64 + 16),  # latency.py
    ("llama-8b b1 32K", 1, (32768, 32768), 32, 8, 32768 + 64 + 16),
    ("llama-8b b32 1K", 32, (1024, 1024), 32, 8, 32768 + 64 + 16),
    ("llama-8b b32 32K", 32, (32768, 32768), 32, 8, 32768 + 64 + 16),
    ("llama-8b b16 1K", 16, (1024, 1024), 32, 8, 32768 + 64 + 16),
    ("llama-8b b4 32K", 4, (32768, 32768), 32, 8, 32768 + 64 + 16),
]
BLOCK = 256
HEAD_DIM = 128


def make_inputs(batch: int, lengths: tuple[int, int], heads: int, kv_heads: int, max_model_len: int, seed: int = 0):
    rng = random.Random(seed)
    seq_lens = [rng.randint(*lengths) for _ in range(batch)]
    blocks = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(max(blocks), -(-max_model_len // BLOCK))
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at : at + n] + [0] * (width - n))
        at += n
    dev = "cuda"
    k_cache = torch.randn(sum(blocks), BLOCK, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, heads, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    tables_t = torch.tensor(tables, dtype=torch.int64, device=dev)
    kv_bytes = sum(seq_lens) * kv_heads * HEAD_DIM * 2 * 2
    return (q, k_cache, v_cache, cu, lens, tables_t, HEAD_DIM**-0.5), kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer launch configurations")
    ap.add_argument("--shapes", nargs="+", default=None, help="only shapes whose name contains one of these")
    ap.add_argument("--block-n", type=int, nargs="+", help="only these KV tile sizes")
    ap.add_argument("--warps", type=int, nargs="+", help="only these warp counts")
    ap.add_argument("--stages", type=int, nargs="+", help="only these pipeline depths")
    ap.add_argument("--splits", type=int, nargs="+", help="only these split counts (else by batch)")
    ap.add_argument("--top", type=int, default=8, help="rows printed per shape")
    args = ap.parse_args()
    require_cuda()
    bandwidth = measure_hbm_bandwidth()
    log(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    grid = dict(block_n=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4))
    if args.quick:
        grid = dict(block_n=(64, 128), num_warps=(4,), num_stages=(2, 3))
    for key, chosen in (("block_n", args.block_n), ("num_warps", args.warps), ("num_stages", args.stages)):
        grid[key] = tuple(chosen or grid[key])
    results = {}
    for name, batch, lengths, heads, kv_heads, max_model_len in SHAPES:
        if args.shapes and not any(part in name for part in args.shapes):
            continue
        inputs, kv_bytes = make_inputs(batch, lengths, heads, kv_heads, max_model_len)
        want = ops.paged_decode_attention(*inputs, num_splits=1)[0]
        default_ms = graph_ms(lambda: ops.paged_decode_attention(*inputs))
        rows = []
        splits_options = args.splits or ((1, 2, 4) if batch >= 64 else (1, 4, 8, 16, 32, 64))
        for block_n, warps, stages, splits in itertools.product(*grid.values(), splits_options):
            fn = lambda: ops.paged_decode_attention(*inputs, num_splits=splits, block_n=block_n,  # noqa: E731
                                                    num_warps=warps, num_stages=stages)
            try:
                got = fn()[0]
            except Exception as exc:  # out of shared memory or registers for this combination
                log(f"  {name}: block_n {block_n} warps {warps} stages {stages} failed: {type(exc).__name__}")
                continue
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            ms = graph_ms(fn)
            rows.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "num_splits": splits,
                         "ms": ms, "of_hbm": kv_bytes / (ms / 1e3) / bandwidth})
        rows.sort(key=lambda r: r["ms"])
        results[name] = {"default_ms": default_ms, "default_of_hbm": kv_bytes / (default_ms / 1e3) / bandwidth,
                         "best": rows[: args.top]}
        log(f"{name}: the engine's launch {default_ms * 1e3:.0f} us ({results[name]['default_of_hbm']:.0%} of HBM)")
        for r in rows[: args.top]:
            log(f"   {r['ms'] * 1e3:7.0f} us {r['of_hbm']:5.0%}  block_n {r['block_n']} warps {r['num_warps']} "
                f"stages {r['num_stages']} splits {r['num_splits']}")
    save_results("tune_decode", results)


if __name__ == "__main__":
    main()
