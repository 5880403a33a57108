"""Sweep the Triton prefill kernel's tiles and pipelining on Llama-3.1-8B prefill shapes (32 query heads,
8 KV heads, head_dim 128, bf16, 256-token blocks): one 8,192-token chunk over a cached prefix of 0, 8K
and 24K tokens (the four chunks of a 32K prompt at the default budget). Each variant is checked against
the default's output; TFLOP/s count the causal pairs. Peer: torch SDPA (cuDNN or flash, the faster) on
the prefix-free chunk.

    PYTHONPATH=. python3 bench/tune_prefill.py [--prefixes 0 8192 24576] [--chunk 8192] [--warp-specialize]

Variants: pointer loads or tensor descriptors (TMA) for the K/V tiles; --warp-specialize sweeps the
descriptors' loop with Triton's warp specialisation instead.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from common import cuda_ms, log, require_cuda, save_results, sdpa_causal_ms
from nanovllm.kernels import triton_paged_attention as ops

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 256
GRID = dict(block_m=(64, 128), block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3, 4), tma=(False, True))
# warp specialisation of the descriptors' loop: a separate process (--warp-specialize), as a failed
# compilation of it could take the process down
WS_GRID = dict(block_m=(128,), block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3), tma=(True,),
               warp_specialize=(True,))


def inputs(chunk: int, prefix: int) -> tuple:
    seq_len = prefix + chunk
    blocks = -(-seq_len // BLOCK)
    cache = lambda: torch.randn(blocks, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    q = torch.randn(chunk, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(blocks, device="cuda")[None]
    cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    return q, cache(), cache(), cu, lens, table, DIM**-0.5


def causal_flops(chunk: int, prefix: int) -> float:
    return 4 * HEADS * DIM * chunk * (prefix + chunk / 2)


def sdpa_ms(chunk: int) -> tuple[float, str]:
    q, k, v = (torch.randn(1, HEADS, chunk, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    return sdpa_causal_ms(q, k, v, repeats=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", nargs="+", type=int, default=[0, 8192, 24576])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--warp-specialize", action="store_true", help="sweep the warp-specialised variants")
    args = ap.parse_args()
    grid = WS_GRID if args.warp_specialize else GRID
    require_cuda()
    default = ops.prefill_config(torch.bfloat16, DIM, BLOCK)
    peer_ms, peer = sdpa_ms(args.chunk)
    log(f"SDPA {peer} on the prefix-free chunk: {peer_ms:.2f} ms, "
        f"{causal_flops(args.chunk, 0) / peer_ms / 1e9:.0f} TFLOP/s")
    results = {"sdpa": dict(ms=peer_ms, backend=peer), "shapes": []}
    for prefix in args.prefixes:
        call = inputs(args.chunk, prefix)
        want = ops.paged_prefill_attention(*call, config=default)[0]
        rows = []
        for values in itertools.product(*grid.values()):
            config = ops.PrefillConfig(**dict(zip(grid, values)))
            if BLOCK % config.block_n:
                continue
            fn = lambda: ops.paged_prefill_attention(*call, config=config)  # noqa: E731
            try:
                got = fn()[0]
            except Exception as exc:  # out of shared memory or registers for this combination
                log(f"  {config}: failed ({type(exc).__name__})")
                continue
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            ms = cuda_ms(fn, 5)
            rows.append(dict(config=vars(config), ms=ms, tflops=causal_flops(args.chunk, prefix) / ms / 1e9))
        rows.sort(key=lambda r: r["ms"])
        base = dict(config=vars(default), ms=cuda_ms(lambda: ops.paged_prefill_attention(*call, config=default), 5))
        base["tflops"] = causal_flops(args.chunk, prefix) / base["ms"] / 1e9
        log(f"chunk {args.chunk} over prefix {prefix}: default {base['ms']:.2f} ms ({base['tflops']:.0f} TFLOP/s)")
        for r in rows[:4]:
            log(f"  {r['config']}: {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s, "
                f"{base['ms'] / r['ms']:.2f}x the default")
        results["shapes"].append(dict(prefix=prefix, default=base, best=rows[:8]))
    save_results("tune_prefill_ws" if args.warp_specialize else "tune_prefill", results)


if __name__ == "__main__":
    main()
