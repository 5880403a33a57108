"""Triton kernels that fuse the elementwise parts of a decoder layer, one launch each instead of 4-10
small PyTorch kernels (at batch 1 a launch costs more than its work).

Numerics follow `nanovllm.layers.fused_ops.LayerOps` (the reference they are tested against), which
follows HF: every intermediate that PyTorch would round to the activation dtype is rounded here too
(`_round`), so the results differ from the reference only by float32 reduction order and exp/rsqrt
approximations. Launches pass enable_fp_fusion=False: otherwise Triton contracts a rounded product and
the following add into one FMA, skipping the rounding (measured: a quarter of bf16 RoPE outputs off by
an ulp, enough to change SmolLM2's bf16 answers). pdl: a dependent launch (kernels/dependent_launch.py).
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


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round a float32 value to the activation dtype and back, as a PyTorch op in that dtype would."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, n_cols, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    let_next_start(PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x.to(dtype), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    tl.store(out_ptr + row * stride_o + offs, (w * _round(x * inv_rms, dtype)).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of a 2-D x. With residual: (norm(x + residual), x + residual)."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    pdl = pdl and dependent_launch.supported(x.device)
    _rms_norm_kernel[(rows,)](
        x, res, out, res_out, weight, cols, eps, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(cols), PDL=pdl, num_warps=_warps(cols),
        enable_fp_fusion=False, launch_pdl=pdl,
    )
    return (out, res_out) if residual is not None else out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    let_next_start(PDL)
    wait_for_previous(PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim of a 2-D tensor."""
    rows, cols = gate_up.shape
    half = cols // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(half))
    pdl = pdl and dependent_launch.supported(gate_up.device)
    _silu_and_mul_kernel[(rows, cdiv(half, block))](gate_up, out, half, gate_up.stride(0), out.stride(0),
                                                          BLOCK=block, PDL=pdl, num_warps=4, enable_fp_fusion=False,
                                                          launch_pdl=pdl)
    return out


@triton.jit
def _norm_rope_heads(src, stride_h, dst, num_heads, w_ptr, c1, c2, s1, s2, eps, dtype: tl.constexpr,
                     HAS_NORM: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, cache_dst, stride_ch,
                     STORE: tl.constexpr):
    """A token's head vectors [num_heads, 2 * HALF] (stride_h apart): optional RMSNorm per head (weight w), then
    rotate-half RoPE with the token's cos/sin halves (c1, c2, s1, s2 [1, HALF]); written contiguous at dst, and
    with STORE also at cache_dst + head * stride_ch."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    offs = tl.arange(0, HALF)[None, :]
    mask = (heads < num_heads) & (offs < HALF)
    x1 = tl.load(src + heads * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + heads * stride_h + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = _round(tl.load(w_ptr + offs).to(tl.float32) * _round(x1 * inv_rms, dtype), dtype)
        x2 = _round(tl.load(w_ptr + HALF + offs).to(tl.float32) * _round(x2 * inv_rms, dtype), dtype)
    y1 = (_round(x1 * c1, dtype) - _round(x2 * s1, dtype)).to(dtype)
    y2 = (_round(x2 * c2, dtype) + _round(x1 * s2, dtype)).to(dtype)
    tl.store(dst + heads * (2 * HALF) + offs, y1, mask=mask)
    tl.store(dst + heads * (2 * HALF) + HALF + offs, y2, mask=mask)
    if STORE:
        tl.store(cache_dst + heads * stride_ch + offs, y1, mask=mask)
        tl.store(cache_dst + heads * stride_ch + HALF + offs, y2, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_vt, stride_vh, stride_slots, stride_cs, stride_ch,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
    STORE: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """One token, all its heads (the cos/sin row read once). STORE: the rotated k and the token's v also into the
    caches (viewed [slots, Hk, D]) at the token's slot."""
    token = tl.program_id(0).to(tl.int64)
    let_next_start(PDL)
    wait_for_previous(PDL)
    dtype = q_out_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + token * stride_cos + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + token * stride_cos + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + token * stride_sin + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + token * stride_sin + HALF + offs).to(tl.float32)
    _norm_rope_heads(q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * NUM_Q_HEADS * HEAD_DIM, NUM_Q_HEADS,
                     qw_ptr, c1, c2, s1, s2, eps, dtype, HAS_NORM, HALF, Q_HEADS_PAD,
                     q_out_ptr, 0, False)
    to_slot = 0
    if STORE:
        to_slot = tl.load(slots_ptr + token * stride_slots).to(tl.int64) * stride_cs
        kv_heads = tl.arange(0, K_HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        kv_mask = (kv_heads < NUM_K_HEADS) & (dims < HEAD_DIM)
        v = tl.load(v_ptr + token * stride_vt + kv_heads * stride_vh + dims, mask=kv_mask)
        tl.store(v_cache_ptr + to_slot + kv_heads * stride_ch + dims, v, mask=kv_mask)
    _norm_rope_heads(k_ptr + token * stride_kt, stride_kh, k_out_ptr + token * NUM_K_HEADS * HEAD_DIM, NUM_K_HEADS,
                     kw_ptr, c1, c2, s1, s2, eps, dtype, HAS_NORM, HALF, K_HEADS_PAD,
                     k_cache_ptr + to_slot, stride_ch, STORE)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (views with unit last stride); cos, sin [T, 1, D]. Optional per-head
    RMSNorm (both weights or neither), then RoPE. Returns new contiguous q and k. store (v [T, Hk, D], k_cache,
    v_cache [num_blocks, block_size, Hk, D] of one layout, slots [T] of any stride): the returned k and v
    are also written at the slots, as `store_kv` would (in the same launch)."""
    tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs a unit stride along head_dim")
    q_out = torch.empty(tokens, num_q, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, num_k, head_dim, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    has_norm = q_weight is not None
    qw = q_weight if has_norm else q
    kw = k_weight if has_norm else k
    store_args = _store_args(k, store) if store is not None else (k, k, k, k, 0, 0, 0, 0, 0)
    pdl = pdl and dependent_launch.supported(q.device)
    _qk_norm_rope_kernel[(tokens,)](
        q, k, q_out, k_out, cos, sin, qw, kw, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), *store_args, NUM_Q_HEADS=num_q, NUM_K_HEADS=num_k, HEAD_DIM=head_dim,
        HAS_NORM=has_norm, STORE=store is not None, Q_HEADS_PAD=next_power_of_2(num_q),
        K_HEADS_PAD=next_power_of_2(num_k), PDL=pdl, num_warps=_warps(num_q * head_dim),
        enable_fp_fusion=False, launch_pdl=pdl,
    )
    return q_out, k_out


def _store_args(k: torch.Tensor, store: tuple[torch.Tensor, ...]) -> tuple:
    v, k_cache, v_cache, slots = store
    num_heads, head_dim = k.shape[1:]
    k_flat, v_flat = k_cache.view(-1, num_heads, head_dim), v_cache.view(-1, num_heads, head_dim)
    if v.shape != k.shape or v.stride(-1) != 1 or k_flat.stride() != v_flat.stride() or k_flat.stride(-1) != 1:
        raise ValueError("qk_norm_rope's store needs v shaped as k, unit strides along head_dim and caches of the "
                         "same layout")
    if not k.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"qk_norm_rope's store: k {k.dtype}, v {v.dtype} and the caches {k_cache.dtype} differ")
    return (v, k_flat, v_flat, slots, v.stride(0), v.stride(1), slots.stride(0), k_flat.stride(0),
            k_flat.stride(1))


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_heads, head_dim, stride_slots,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token * stride_slots).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    to_slot = slot * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + to_slot, tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache_ptr + to_slot, tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hk, D] (unit last stride) into the caches' flat slots [T] (any stride: a decode graph's
    slots are a column of its input rows) of the caches viewed [slots, Hk, D] (the same strides for both):
    one launch where two index_copy_ take two."""
    tokens, num_heads, head_dim = k.shape
    k_flat, v_flat = k_cache.view(-1, num_heads, head_dim), v_cache.view(-1, num_heads, head_dim)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_flat.stride() != v_flat.stride() or k_flat.stride(-1) != 1:
        raise ValueError("store_kv needs a unit stride along head_dim and caches of the same layout")
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k, v, k_flat, v_flat, slots, num_heads, head_dim, slots.stride(0), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_flat.stride(0), k_flat.stride(1),
        HEADS_PAD=next_power_of_2(num_heads), DIM_PAD=next_power_of_2(head_dim),
        num_warps=_warps(num_heads * head_dim),
    )


def _warps(cols: int) -> int:
    return 1 if cols <= 512 else 4 if cols <= 4096 else 8
