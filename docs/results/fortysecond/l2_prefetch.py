"""Probe: does prefetching a GEMV's weights into L2 while a latency-bound kernel runs make the GEMV faster?

Per layer of the Llama-3.1-8B shape at batch 1 x 1K: the decode attention (HBM nearly idle) then the o-projection
GEMV; with --prefetch a kernel issues `cp.async.bulk.prefetch.L2` of o's weights first (fire and forget, PDL).
32 layers' weights (more than L2) in one CUDA graph, mean per layer.
"""
import sys

import torch
import triton
import triton.language as tl

from nanovllm.kernels.dependent_launch import let_next_start, wait_for_previous
from nanovllm.kernels.triton_gemv import gemv
from nanovllm.kernels import triton_paged_attention as ops
from probe_common import graph_us


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, PDL: tl.constexpr,
                     WAIT: tl.constexpr):
    let_next_start(PDL)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * (PER_PROGRAM * CHUNK) + tl.arange(0, PER_PROGRAM).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    ok = (size > 0).to(tl.int32)
    addr = (ptr + offs).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [addr, tl.maximum(size, 16), ok], dtype=tl.int32, is_pure=False, pack=1)
    if WAIT:
        wait_for_previous(PDL)


def prefetch(w: torch.Tensor, chunk: int = 65536, per_program: int = 32, pdl: bool = True, wait: bool = True):
    flat = w.view(-1).view(torch.uint8)
    n = flat.numel()
    grid = triton.cdiv(n, chunk * per_program)
    _prefetch_kernel[(grid,)](flat, n, CHUNK=chunk, PER_PROGRAM=per_program, PDL=pdl, WAIT=wait, num_warps=1,
                              launch_pdl=pdl)


def main():
    torch.manual_seed(0)
    dev = "cuda"
    L, H, Hq, Hk, D, B = 32, 4096, 32, 8, 128, 256
    ctx, width = 1024, (32768 + 64 + 16 + B - 1) // B
    o_w = [torch.randn(H, H, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(L)]
    gu_w = [torch.randn(2 * 14336, H, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(L)]
    nblk = ctx // B
    kc = [torch.randn(nblk, B, Hk, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    vc = [torch.randn_like(k) for k in kc]
    q = torch.randn(1, Hq, D, dtype=torch.bfloat16, device=dev)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    tables = torch.zeros(1, width, dtype=torch.int64, device=dev)
    tables[0, :nblk] = torch.arange(nblk, device=dev)
    x = torch.randn(1, H, dtype=torch.bfloat16, device=dev)

    def attn(i):
        return ops.paged_decode_attention(q, kc[i], vc[i], cu, lens, tables, D**-0.5, pdl=True)[0]

    side = torch.cuda.Stream()

    def run(mode, chunk=65536, per_program=32):
        def fn():
            for i in range(L):
                if mode == "gemv only":
                    gemv(x, o_w[i], pdl=True)
                    continue
                if mode == "attn only":
                    attn(i)
                    continue
                if mode == "prefetch":
                    prefetch(o_w[i], chunk, per_program)
                if mode.startswith("side"):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        prefetch(o_w[i], chunk, per_program, pdl=False, wait=False)
                a = attn(i)
                if mode == "side join":
                    torch.cuda.current_stream().wait_stream(side)
                gemv(a.view(1, -1), o_w[i], pdl=True)
                if mode == "side end":
                    torch.cuda.current_stream().wait_stream(side)
        return fn

    def gate_up(mode, mb, chunk=4096, per_program=32):
        def fn():
            for i in range(L):
                if mode == "prefetch":
                    prefetch(gu_w[i][: mb * 1024 * 1024 // (2 * H)], chunk, per_program)
                attn(i)
                torch.nn.functional.linear(x, gu_w[i])
        return fn

    want = torch.nn.functional.linear(x.float(), o_w[0].float())
    prefetch(o_w[0])
    torch.testing.assert_close(gemv(x, o_w[0]).float(), want, atol=2e-2, rtol=2e-2)
    print(torch.cuda.get_device_name(), flush=True)
    for rep in range(2):
        for mode in ("gemv only", "attn only", "plain"):
            print(f"{rep} o: {mode:16s} {graph_us(run(mode), L):7.2f} us/layer", flush=True)
        for mode in ("prefetch", "side join", "side end"):
            for chunk, per_program in ((65536, 32), (4096, 32), (16384, 8), (2048, 64), (1024, 128)):
                us = graph_us(run(mode, chunk, per_program), L)
                print(f"{rep} o: {mode:10s} chunk {chunk:6d} x {per_program:3d} {us:7.2f} us/layer", flush=True)
        for mode, mb in (("plain", 0), ("prefetch", 8), ("prefetch", 16), ("prefetch", 32)):
            print(f"{rep} gate_up after attn: {mode} {mb} MB {graph_us(gate_up(mode, mb), L):7.2f} us/layer",
                  flush=True)

if __name__ == "__main__":
    sys.exit(main())
