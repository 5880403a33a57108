"""Decode-step GEMMs of the throughput model (Qwen3-0.6B: hidden 1024, q/k/v 4096, o 2048->1024, gate/up 6144,
down 3072->1024) at batches 256-32: cuBLAS (F.linear) against a plain Triton tl.dot GEMM over a few tiles, each
timed as 50 calls in one CUDA graph, and against the HBM time of its weight. A probe: whether a Triton GEMM is
worth wiring in for large decode batches.

    python3 gemm_probe.py
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}


@triton.jit
def _gemm(x_ptr, w_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          SPLIT_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    per = K // SPLIT_K
    for k in range(pid_k * per, (pid_k + 1) * per, BK):
        a = tl.load(x_ptr + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + (k + rk)[:, None])
        acc = tl.dot(a, b, acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask, sem="relaxed")


def triton_linear(x, w, out, bm, bn, bk, split_k, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    if split_k > 1:
        out.zero_()
    _gemm[(triton.cdiv(M, bm), triton.cdiv(N, bn), split_k)](x, w, out, M, N, K, BM=bm, BN=bn, BK=bk,
                                                             SPLIT_K=split_k, num_warps=warps, num_stages=stages)
    return out


def graph_us(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(4):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / (4 * reps))
    return best


def copy_rate():
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), reps=5)
    return 2 * a.numel() / (us * 1e-6)


def main():
    rate = copy_rate()
    print(f"HBM copy {rate / 1e12:.2f} TB/s")
    tiles = [(bm, bn, bk, sk, 8 if bm * bn >= 16384 else 4, st) for bm, bn in ((32, 64), (64, 32), (64, 64),
             (64, 128), (128, 64), (128, 128)) for bk in (64, 128) for sk in (1, 2, 4) for st in (3, 4)]
    for m in (256, 128, 64, 32):
        tot_cublas = tot_triton = tot_floor = 0.0
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            ref = F.linear(x, w)
            cublas = graph_us(lambda: F.linear(x, w))
            floor = (n * k * 2 + m * (k + n) * 2) / rate * 1e6
            best = (float("inf"), None)
            for t in tiles:
                bm, bn, bk, sk, warps, stages = t
                if k % (bk * sk):
                    continue
                out = torch.empty(m, n, device="cuda", dtype=torch.float32 if sk > 1 else torch.bfloat16)
                try:
                    got = triton_linear(x, w, out, *t)
                    torch.cuda.synchronize()
                    if not torch.allclose(got.float(), ref.float(), atol=3e-2, rtol=3e-2):
                        continue
                    us = graph_us(lambda: triton_linear(x, w, out, *t))
                except Exception:  # a tile the compiler rejects (shared memory)
                    continue
                best = min(best, (us, t))
            tot_cublas += cublas
            tot_triton += best[0]
            tot_floor += floor
            print(f"M {m:4d} {name:8s}: cuBLAS {cublas:6.2f} us, Triton {best[0]:6.2f} us {best[1]} "
                  f"({cublas / best[0]:.2f}x); weight floor {floor:5.2f} us (cuBLAS {cublas / floor:.2f}x)", flush=True)
        print(f"M {m:4d} layer: cuBLAS {tot_cublas:.1f} us, best Triton {tot_triton:.1f} us, floor {tot_floor:.1f} us")


if __name__ == "__main__":
    main()
