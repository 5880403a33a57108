"""A linear layer for decode steps of a few rows: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias), M <= 16.

At batch 1 cuBLAS runs the Llama-3.1-8B shape's narrow projections (q/k/v and o) at ~0.77 of the HBM rate and
splits K in two of the four GEMMs of a layer, each followed by a reduction kernel (`bench/profile_decode.py` on the
H200: 26.5 us a layer for 83 MB of weights, plus 3.6 us of reductions). Here one program owns BLOCK_N output
columns over the whole of K: each weight row is read once, accumulated in float32, and written by the program
that summed it (no split, no second kernel). Two ways to multiply: tl.dot with the rows padded to 16 (the
extra products cost nothing next to the weight reads; the weight tile goes through shared memory), or products
summed in registers (up to 4 rows; the tile stays in registers, as a GEMV reduction kernel keeps it).
`bench/tune_gemv.py` times both against cuBLAS per shape. On the H200 the register form at 1 row beat cuBLAS on
three of Llama-3.1-8B's four projections (1.03x a layer), the fused prologues lost (0.83-0.90x at 1 row); the
model keeps F.linear (`TritonLayerOps.gemv_rows` 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_fused import _round
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

MAX_ROWS = 16  # rows of x one launch serves (tl.dot's smallest M)
MAX_REGISTER_ROWS = 4  # rows of x the register products serve
PLAIN, SILU_MUL, RMS_NORM = 0, 1, 2  # what the kernel makes of x before the product (its PROLOGUE)


@triton.jit
def _input_tile(x_ptrs, res_ptrs, norm_ptrs, inv_rms, mask, k_mask, half_k, dtype: tl.constexpr,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One [ROWS, BLOCK_K] tile of the product's input, rounded as LayerOps' separate ops round it."""
    if PROLOGUE == 1:  # x = [gate | up]: silu(gate) * up
        gate = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptrs + half_k, mask=mask, other=0.0).to(tl.float32)
        return (_round(gate / (1.0 + tl.exp(-gate)), dtype) * up).to(dtype)
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if PROLOGUE == 2:  # weight * rms_norm(x (+ residual))
        x = x.to(tl.float32)
        if HAS_RESIDUAL:
            x = _round(x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32), dtype)
        weight = tl.load(norm_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        x = (weight[None, :] * _round(x * inv_rms[:, None], dtype)).to(dtype)
    return x


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    res_ptr, res_out_ptr, norm_ptr, eps, stride_rm, stride_rom,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, USE_DOT: tl.constexpr,
):
    """PROLOGUE RMS_NORM: a first pass over x's rows for their RMS (program 0 also writes x + residual);
    SILU_MUL: x holds [gate | up], K columns each."""
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    res_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
    inv_rms = tl.zeros([ROWS], dtype=tl.float32)
    if PROLOGUE == 2:
        squares = tl.zeros([ROWS], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            mask = m_mask[:, None] & (offs_k < K - k)[None, :]
            x = tl.load(x_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x = _round(x + tl.load(res_ptrs + k, mask=mask, other=0.0).to(tl.float32), dtype)
                if pid == 0:
                    tl.store(res_out_ptr + offs_m[:, None] * stride_rom + k + offs_k[None, :], x.to(dtype), mask=mask)
            squares += tl.sum(x * x, 1)
        inv_rms = tl.rsqrt(squares / K + eps)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if not USE_DOT:
        products = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = _input_tile(x_ptrs, res_ptrs, norm_ptr + k + offs_k, inv_rms, m_mask[:, None] & k_mask[None, :], k_mask, K,
                        dtype, PROLOGUE, HAS_RESIDUAL)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        else:
            products += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        res_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(products, 2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 32,
         block_k: int = 256, num_warps: int = 4, num_stages: int = 3, use_dot: bool = True, silu_mul: bool = False,
         norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """F.linear(x, weight, bias) for x [M, K] with M <= MAX_ROWS, in x's dtype (float32 accumulation), of:
    silu_mul: silu(gate) * up for x = [gate | up] ([M, 2K]), as LayerOps.silu_and_mul;
    norm (weight [K], eps): LayerOps.rms_norm of x, or with residual LayerOps.add_rms_norm (then returns the
    product and x + residual). use_dot False: products summed in registers (at most MAX_REGISTER_ROWS rows)."""
    k = weight.shape[-1] if weight.dim() == 2 else -1
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv needs x [M, {'2K' if silu_mul else 'K'}] and weight [N, K], got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    most = MAX_ROWS if use_dot else MAX_REGISTER_ROWS
    if not 1 <= x.shape[0] <= most:
        raise ValueError(f"gemv serves 1..{most} rows{'' if use_dot else ' without tl.dot'}, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must match, bias [N]")
    if (silu_mul and norm is not None) or (residual is not None and norm is None):
        raise ValueError("gemv takes one prologue: silu_mul, or norm (with or without residual)")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} must be shaped as x {tuple(x.shape)}")
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    prologue = SILU_MUL if silu_mul else RMS_NORM if norm is not None else PLAIN
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        res, summed, norm_weight, eps, res.stride(0), summed.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None, ROWS=16 if use_dot else triton.next_power_of_2(m), USE_DOT=use_dot,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )
    return (out, summed) if residual is not None else out
