"""A linear layer for decode steps of a few rows: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias), M <= 4.

At batch 1 cuBLAS runs the narrow projections of a decoder layer (Llama-3.1-8B's q/k/v, o and down) below the HBM
rate and splits K for some of them, each split followed by a reduction kernel. Here one program owns BLOCK_N output
columns over the whole of K: each weight row is read once, the products are summed in float32 registers (no
shared-memory tile, no split, no second kernel) and written by the program that summed them. On the H200
(`bench/tune_gemv.py`, thirty-third session) this beat cuBLAS at 1 row on q/k/v 1.08x, o 1.34x and down 1.04x,
not on the wide gate/up projection (0.97x); tl.dot over rows padded to 16 and the norm or SiLU * up fused in
front of the product were slower than cuBLAS plus the separate op, so neither is kept.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import dependent_launch
from nanovllm.kernels.dependent_launch import let_next_start, wait_for_previous
from nanovllm.kernels.sizes import cdiv, next_power_of_2
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

MAX_ROWS = 4  # rows of x one launch serves: their products stay in registers


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """PDL (a dependent launch): the first weight tile is loaded before waiting for the kernel that wrote x."""
    pid = tl.program_id(0)
    let_next_start(PDL)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    products = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    start = 0
    if PDL:
        k_mask = offs_k < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # weights: no kernel writes them
        wait_for_previous(PDL)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        products += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        start = BLOCK_K
    for k in range(start, K, BLOCK_K):
        k_mask = offs_k < K - k
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        products += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc = tl.sum(products, 2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv_tiles(n: int, k: int) -> tuple[int, int]:
    """(block_n, block_k) for a weight [n, k]: the H200 tune's best at Llama-3.1-8B's shapes (block_k 1024; 4
    columns a program where the output is wider than K (q/k/v), else 8 (o, down))."""
    return (4 if n > k else 8), min(1024, next_power_of_2(k))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int = 4, num_stages: int = 1, pdl: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] with M <= MAX_ROWS, in x's dtype (float32 accumulation); tiles
    default to `gemv_tiles`. pdl: a dependent launch (kernels/dependent_launch.py) where the device has them."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must match, bias [N]")
    (m, k), n = x.shape, weight.shape[0]
    default_n, default_k = gemv_tiles(n, k)
    block_n, block_k = block_n or default_n, block_k or default_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = pdl and dependent_launch.supported(x.device)
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, ROWS=next_power_of_2(m), PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False, launch_pdl=pdl,
    )
    return out
