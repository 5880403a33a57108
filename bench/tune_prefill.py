"""Sweep the Triton prefill kernel's tiles and pipelining on Llama-3.1-8B prefill shapes (32 query heads,
8 KV heads, head_dim 128, bf16, 256-token blocks): one 8,192-token chunk over a cached prefix of 0, 8K
and 24K tokens (the four chunks of a 32K prompt at the default budget). Each variant is checked against
the default's output; TFLOP/s count the causal pairs. Peer: torch SDPA (cuDNN or flash, the faster) on
the prefix-free chunk.

    PYTHONPATH=. python3 bench/tune_prefill.py [--prefixes 0 8192 24576] [--chunk 8192] [--head-dim 128]
    PYTHONPATH=. python3 bench/tune_prefill.py --xattention-contexts 131072 [--threshold 0.9]
    PYTHONPATH=. python3 bench/tune_prefill.py --xattention-contexts 131072 --block-m 128 256 --warps 8 --pack 0 1

--block-m / --block-n / --warps / --stages / --tma / --pack replace that axis of the sweep (default: GRID; a
256-row query tile only when asked for).

--xattention-contexts sweeps the same variants on the block-sparse prefill instead: one layer of XAttention over
bench/sparse.py's shaped inputs (its estimate and selection, then the kernel over per-KV-head tables of the selected
blocks), each variant against the default's output, the estimate's time taken off.

Variants: pointer loads or tensor descriptors (TMA) for the K/V tiles; a program per query head or per KV head
(pack_heads: its query heads' rows together, each K/V tile loaded once for them).
"""
from __future__ import annotations

import argparse
import itertools

import torch

from common import cuda_ms, log, require_cuda, save_results, sdpa_causal_ms
from nanovllm.kernels import triton_paged_attention as ops

HEADS, KV_HEADS, BLOCK = 32, 8, 256
GRID = dict(block_m=(64, 128), block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3, 4), tma=(False, True),
            pack_heads=(False, True))


def inputs(chunk: int, prefix: int, dim: int) -> tuple:
    seq_len = prefix + chunk
    blocks = -(-seq_len // BLOCK)
    cache = lambda: torch.randn(blocks, BLOCK, KV_HEADS, dim, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    q = torch.randn(chunk, HEADS, dim, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(blocks, device="cuda")[None]
    cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    return q, cache(), cache(), cu, lens, table, dim**-0.5


def causal_flops(chunk: int, prefix: int, dim: int) -> float:
    return 4 * HEADS * dim * chunk * (prefix + chunk / 2)


def sdpa_ms(chunk: int, dim: int) -> tuple[float, str]:
    q, k, v = (torch.randn(1, HEADS, chunk, dim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    return sdpa_causal_ms(q, k, v, repeats=5)


def variants(grid: dict) -> list:
    """Every PrefillConfig of the grid whose key tile divides the cache block."""
    configs = (ops.PrefillConfig(**dict(zip(grid, values))) for values in itertools.product(*grid.values()))
    return [c for c in configs if BLOCK % c.block_n == 0]


def sweep_xattention(context: int, threshold: float, grid: dict, stride: int = 16) -> dict:
    """ms of one XAttention prefill layer's attention (the layer less its estimate) per kernel variant, the
    variants' outputs checked against the default's."""
    from sparse import BLOCK as CACHE_BLOCK, DIM, KV_HEADS as HK, shaped_inputs, sparse_batch
    from nanovllm.engine.kv_cache import PagedKVCache
    from nanovllm.layers.attention import get_attention_backend
    from nanovllm.layers.kv_access import DeviceKV
    from nanovllm.layers.xattention import XAttentionSelector

    q, k, v = shaped_inputs(context, seed=context)
    blocks = -(-context // CACHE_BLOCK)
    cache = PagedKVCache(1, blocks, CACHE_BLOCK, HK, DIM, torch.bfloat16, torch.device("cuda"))
    backend = get_attention_backend("triton")
    table = torch.randperm(blocks).tolist()
    slots = [table[p // CACHE_BLOCK] * CACHE_BLOCK + p % CACHE_BLOCK for p in range(context)]
    metadata = lambda: backend.build_metadata([context], [context], [table], slots, CACHE_BLOCK,  # noqa: E731
                                              torch.device("cuda"))
    selector = XAttentionSelector(cache, None, threshold, stride, 128, min_context=0)
    estimate_ms = cuda_ms(lambda: selector.select(0, q, HK, sparse_batch(metadata())), 3)
    default_config = ops.prefill_config

    def layer(config: ops.PrefillConfig | None) -> tuple[float, torch.Tensor]:
        ops.prefill_config = default_config if config is None else (lambda *a, **kw: config)
        try:  # a fresh step's metadata: its plan (config, schedule) is made with this variant
            kv = DeviceKV(cache, backend, metadata(), selector)
            out = kv.attend(0, q, k, v, DIM**-0.5)
            return cuda_ms(lambda: kv.attend(0, q, k, v, DIM**-0.5), 3) - estimate_ms, out
        finally:
            ops.prefill_config = default_config

    base_ms, want = layer(None)
    rows = []
    for config in variants(grid):
        try:
            ms, got = layer(config)
        except Exception as exc:  # out of shared memory or registers for this combination
            log(f"  {config}: failed ({type(exc).__name__})")
            continue
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        rows.append(dict(config=vars(config), ms=ms))
    rows.sort(key=lambda r: r["ms"])
    log(f"XAttention layer at {context}: estimate {estimate_ms:.1f} ms, attention with the default "
        f"{vars(default_config(torch.bfloat16, DIM, CACHE_BLOCK))} {base_ms:.1f} ms")
    for r in rows[:6]:
        log(f"  {r['config']}: {r['ms']:.1f} ms, {base_ms / r['ms']:.2f}x the default")
    return dict(context=context, threshold=threshold, estimate_ms=estimate_ms, default_ms=base_ms, best=rows[:8])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", nargs="+", type=int, default=[0, 8192, 24576])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--xattention-contexts", nargs="+", type=int, default=[],
                    help="sweep the block-sparse prefill instead: one XAttention layer at each context")
    ap.add_argument("--threshold", type=float, default=0.9, help="XAttention's threshold for --xattention-contexts")
    for flag, key, choices in (("--block-m", "block_m", (64, 128, 256)), ("--block-n", "block_n", (32, 64, 128)),
                               ("--warps", "num_warps", (4, 8)), ("--stages", "num_stages", (2, 3, 4)),
                               ("--tma", "tma", (0, 1)), ("--pack", "pack_heads", (0, 1))):
        ap.add_argument(flag, dest=key, nargs="+", type=int, choices=choices, help=f"the sweep's {key} values")
    args = ap.parse_args()
    grid = {key: tuple(getattr(args, key) or values) for key, values in GRID.items()}
    grid["tma"], grid["pack_heads"] = (tuple(bool(v) for v in grid[k]) for k in ("tma", "pack_heads"))
    require_cuda()
    if args.xattention_contexts:
        save_results("tune_prefill_xattention",
                     {"layers": [sweep_xattention(c, args.threshold, grid) for c in args.xattention_contexts]})
        return
    default = ops.prefill_config(torch.bfloat16, args.head_dim, BLOCK)
    peer_ms, peer = sdpa_ms(args.chunk, args.head_dim)
    log(f"SDPA {peer} on the prefix-free chunk: {peer_ms:.2f} ms, "
        f"{causal_flops(args.chunk, 0, args.head_dim) / peer_ms / 1e9:.0f} TFLOP/s")
    results = {"sdpa": dict(ms=peer_ms, backend=peer), "shapes": []}
    for prefix in args.prefixes:
        call = inputs(args.chunk, prefix, args.head_dim)
        want = ops.paged_prefill_attention(*call, config=default)[0]
        rows = []
        for config in variants(grid):
            fn = lambda: ops.paged_prefill_attention(*call, config=config)  # noqa: E731
            try:
                got = fn()[0]
            except Exception as exc:  # out of shared memory or registers for this combination
                log(f"  {config}: failed ({type(exc).__name__})")
                continue
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            ms = cuda_ms(fn, 5)
            rows.append(dict(config=vars(config), ms=ms, tflops=causal_flops(args.chunk, prefix, args.head_dim) / ms / 1e9))
        rows.sort(key=lambda r: r["ms"])
        base = dict(config=vars(default), ms=cuda_ms(lambda: ops.paged_prefill_attention(*call, config=default), 5))
        base["tflops"] = causal_flops(args.chunk, prefix, args.head_dim) / base["ms"] / 1e9
        log(f"chunk {args.chunk} over prefix {prefix}: default {base['ms']:.2f} ms ({base['tflops']:.0f} TFLOP/s)")
        for r in rows[:4]:
            log(f"  {r['config']}: {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s, "
                f"{base['ms'] / r['ms']:.2f}x the default")
        results["shapes"].append(dict(prefix=prefix, default=base, best=rows[:8]))
    save_results(f"tune_prefill_d{args.head_dim}", results)


if __name__ == "__main__":
    main()
