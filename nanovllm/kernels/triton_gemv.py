"""A linear layer for decode steps of a few rows: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias), M <= 16.

At batch 1 cuBLAS runs the Llama-3.1-8B shape's narrow projections (q/k/v and o) at ~0.77 of the HBM rate and
splits K in two of the four GEMMs of a layer, each followed by a reduction kernel (`bench/profile_decode.py` on the
H200: 26.5 us a layer for 83 MB of weights, plus 3.6 us of reductions). Here one program owns BLOCK_N output
columns over the whole of K: each weight row is read once, accumulated in float32, and written by the program
that summed it (no split, no second kernel). The rows are padded to 16 for tl.dot; the extra products cost
nothing next to the weight reads. `bench/tune_gemv.py` times it against cuBLAS per shape; the model keeps
F.linear until that says which is faster.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

MAX_ROWS = 16  # rows of x one launch serves (tl.dot's smallest M)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 32,
         block_k: int = 256, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] with M <= MAX_ROWS, in x's dtype (float32 accumulation)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must match, bias [N]")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    return out
