"""Sweep the decode kernel's launch choices when it reads Quest's selected 16-token pages in place from
pinned host memory (the narrowed offload step of issue #15): Llama-3.1-8B shape (32 query heads, 8 KV
heads, head_dim 128, bf16), a 128K-token host pool in 256-token blocks viewed as pages, per KV head
`--pages` random pages. Each variant is checked against the engine's default launch; the peer is the
copy engine moving the same number of bytes from pinned memory in one contiguous copy (the PCIe floor).

    PYTHONPATH=. python3 bench/tune_host_decode.py [--batches 1 4] [--pages 160]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from common import cuda_ms, log, require_cuda, save_results
from nanovllm.kernels import triton_paged_attention as ops
from nanovllm.kernels.reference import HostKV
from nanovllm.layers.kv_access import page_views

HEADS, KV_HEADS, DIM, BLOCK, PAGE = 32, 8, 128, 256, 16
HOST_BLOCKS = 512  # 128K tokens per sequence
GRID = dict(num_warps=(1, 2, 4, 8), num_stages=(1, 2, 3), num_splits=(16, 32, 64))


def inputs(batch: int, pages: int) -> tuple:
    host = lambda: torch.empty(HOST_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16).normal_().pin_memory()  # noqa: E731
    device = lambda: torch.zeros(4, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    k, v, host_kv = page_views(PAGE, device(), device(), HostKV(host(), host(), 4 * BLOCK // PAGE))
    per_seq = HOST_BLOCKS * BLOCK // PAGE  # the sequences draw their pages from one pool
    tables = torch.stack([torch.stack([torch.randperm(per_seq)[:pages].sort().values for _ in range(KV_HEADS)])
                          for _ in range(batch)]) + host_kv.base
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch, KV_HEADS), pages * PAGE, dtype=torch.int32, device="cuda")
    return (q, k, v, cu, lens, tables.cuda(), DIM**-0.5), host_kv


def pcie_ms(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return cuda_ms(lambda: dst.copy_(src, non_blocking=True), 10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--pages", type=int, default=160, help="pages per KV head (budget 2048 + sink + recent)")
    args = ap.parse_args()
    require_cuda()
    results = []
    for batch in args.batches:
        call, host_kv = inputs(batch, args.pages)
        nbytes = 2 * batch * KV_HEADS * args.pages * PAGE * DIM * 2
        floor = pcie_ms(nbytes)
        want = ops.paged_decode_attention(*call, host_kv=host_kv)[0]
        base_ms = cuda_ms(lambda: ops.paged_decode_attention(*call, host_kv=host_kv), 20)
        log(f"batch {batch}: {nbytes / 1e6:.1f} MB per layer, copy engine {floor * 1e3:.0f} us "
            f"({nbytes / floor / 1e6:.1f} GB/s); default launch {base_ms * 1e3:.0f} us ({floor / base_ms:.2f} of the floor)")
        rows = []
        for warps, stages, splits in itertools.product(*GRID.values()):
            fn = lambda: ops.paged_decode_attention(*call, host_kv=host_kv, num_splits=splits,  # noqa: E731
                                                    num_warps=warps, num_stages=stages)
            torch.testing.assert_close(fn()[0], want, atol=2e-2, rtol=2e-2)
            ms = cuda_ms(fn, 20)
            rows.append(dict(num_warps=warps, num_stages=stages, num_splits=splits, us=ms * 1e3,
                             gbps=nbytes / ms / 1e6, of_floor=floor / ms))
        rows.sort(key=lambda r: r["us"])
        for r in rows[:5]:
            log(f"  warps {r['num_warps']} stages {r['num_stages']} splits {r['num_splits']}: {r['us']:.0f} us, "
                f"{r['gbps']:.1f} GB/s, {r['of_floor']:.2f} of the floor, {base_ms * 1e3 / r['us']:.2f}x the default")
        results.append(dict(batch=batch, bytes=nbytes, floor_us=floor * 1e3, default_us=base_ms * 1e3, best=rows[:10]))
    save_results("tune_host_decode", results)


if __name__ == "__main__":
    main()
