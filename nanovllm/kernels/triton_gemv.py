"""A linear layer for decode steps of a few rows: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias), M <= 4.

At batch 1 cuBLAS runs the narrow projections of a decoder layer (Llama-3.1-8B's q/k/v, o and down) below the HBM
rate and splits K for some of them, each split followed by a reduction kernel. Here one program owns BLOCK_N output
columns over the whole of K: each weight row is read once, the products are summed in float32 registers (no
shared-memory tile, no split, no second kernel) and written by the program that summed them. On the H200
(`bench/tune_gemv.py`, thirty-third session) this beat cuBLAS at 1 row on q/k/v 1.08x, o 1.34x and down 1.04x,
not on the wide gate/up projection (0.97x); tl.dot over rows padded to 16 and the norm or SiLU * up fused in
front of the product were slower than cuBLAS plus the separate op, so neither is kept. Behind the product, in the
epilogue, two ops cost nothing and save a launch each: RoPE with the k/v store for the q/k/v projection
(`gemv_rope`) and SiLU * up for gate/up (`gemv_silu`, which also makes gate/up a dependent launch, unlike cuBLAS):
batch-1 decode 5.94 -> 5.49 ms a token at 1K on an H100 with both and the decode kernels' early reads
(docs/BENCHMARKS.md, forty-second session).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import dependent_launch
from nanovllm.kernels.dependent_launch import let_next_start, wait_for_previous
from nanovllm.kernels.triton_fused import _round  # the same rounding as the RoPE and SiLU kernels
from nanovllm.kernels.sizes import cdiv, next_power_of_2
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

MAX_ROWS = 4  # rows of x one launch serves: their products stay in registers


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin, stride_slots, stride_cs, stride_ch,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 2, Q_COLS: tl.constexpr = 0, K_COLS: tl.constexpr = 0,
    STORE: tl.constexpr = False, SILU: tl.constexpr = False,
):
    """PDL (a dependent launch): the first weight tile is loaded before waiting for the kernel that wrote x.
    ROPE (the q/k/v projection): a program's columns are BLOCK_N / 2 pairs (c, c + HEAD_DIM / 2) of one head, so that
    its epilogue rotates the q and k columns ([0, Q_COLS + K_COLS)) by RoPE with each row's cos/sin (as
    `triton_fused.qk_norm_rope`, from the output rounded to its dtype); STORE also writes the k and v columns at each
    row's slot of the caches (viewed [slots, Hk, HEAD_DIM]). cos, sin and slots are read before the wait: they are
    made once per forward, not by the kernel before this one. SILU (the gate/up projection, gate columns then up
    columns): a program's columns are pairs (c, c + N / 2) and it writes silu(gate) * up [M, N / 2] (as
    `triton_fused.silu_and_mul` of the output rounded to its dtype)."""
    pid = tl.program_id(0)
    let_next_start(PDL)
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    HALF: tl.constexpr = HEAD_DIM // 2
    if ROPE:  # lanes 2j and 2j + 1: the pair's two columns
        lanes = tl.arange(0, BLOCK_N)
        pair = pid * (BLOCK_N // 2) + lanes // 2
        offs_n = (pair // HALF) * HEAD_DIM + pair % HALF + (lanes % 2) * HALF
        first = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # the pairs, as their first column's index
        angle = (first % HALF)[None, :]
        cos_row, sin_row = cos_ptr + offs_m[:, None] * stride_cos, sin_ptr + offs_m[:, None] * stride_sin
        c1 = tl.load(cos_row + angle, mask=m_mask[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(cos_row + HALF + angle, mask=m_mask[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(sin_row + angle, mask=m_mask[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(sin_row + HALF + angle, mask=m_mask[:, None], other=0.0).to(tl.float32)
        rotated = ((first // HALF) * HEAD_DIM < Q_COLS + K_COLS)[None, :]
    elif SILU:
        lanes = tl.arange(0, BLOCK_N)
        offs_n = pid * (BLOCK_N // 2) + lanes // 2 + (lanes % 2) * (N // 2)
        first = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if STORE:
        slots = tl.load(slots_ptr + offs_m * stride_slots, mask=m_mask, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
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
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if ROPE:
        x1, x2 = tl.split(tl.reshape(out.to(tl.float32), [ROWS, BLOCK_N // 2, 2]))
        y1 = _round(x1 * c1, dtype) - _round(x2 * s1, dtype)
        y2 = _round(x2 * c2, dtype) + _round(x1 * s2, dtype)
        y = tl.reshape(tl.join(tl.where(rotated, y1, x1), tl.where(rotated, y2, x2)), [ROWS, BLOCK_N])
        out = y.to(dtype)
    if SILU:
        gate, up = tl.split(tl.reshape(out.to(tl.float32), [ROWS, BLOCK_N // 2, 2]))
        out = (_round(gate / (1.0 + tl.exp(-gate)), dtype) * up).to(dtype)
        tl.store(out_ptr + offs_m[:, None] * stride_om + first[None, :], out,
                 mask=m_mask[:, None] & (first < N // 2)[None, :])
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])
    if STORE:  # k columns [Q_COLS, Q_COLS + K_COLS) to the k cache, v columns after them to the v cache
        is_v = offs_n >= Q_COLS + K_COLS
        kv_col = tl.where(is_v, offs_n - Q_COLS - K_COLS, offs_n - Q_COLS)
        to_slot = slots[:, None] * stride_cs + ((kv_col // HEAD_DIM) * stride_ch + kv_col % HEAD_DIM)[None, :]
        written = m_mask[:, None] & (n_mask & (offs_n >= Q_COLS))[None, :]
        tl.store(k_cache_ptr + to_slot, out, mask=written & ~is_v[None, :])
        tl.store(v_cache_ptr + to_slot, out, mask=written & is_v[None, :])


def gemv_tiles(n: int, k: int) -> tuple[int, int]:
    """(block_n, block_k) for a weight [n, k]: the H200 tune's best at Llama-3.1-8B's shapes (block_k 1024; 4
    columns a program where the output is wider than K (q/k/v), else 8 (o, down))."""
    return (4 if n > k else 8), min(1024, next_power_of_2(k))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int = 4, num_stages: int = 1, pdl: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] with M <= MAX_ROWS, in x's dtype (float32 accumulation); tiles
    default to `gemv_tiles`. pdl: a dependent launch (kernels/dependent_launch.py) where the device has them."""
    _check(x, weight, bias)
    return _launch(x, weight, bias, block_n, block_k, num_warps, num_stages, pdl)


def gemv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head_dim: int, num_heads: int,
              num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
              store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pdl: bool = False) -> torch.Tensor:
    """The q/k/v projection [M, (Hq + 2 Hk) * head_dim] (q, k, v side by side) with RoPE applied to its q and k
    heads (rotate-half, cos / sin [M, 1, head_dim] of each row's position), as `gemv` then
    `triton_fused.qk_norm_rope` without the norm would make them; store (k_cache, v_cache [blocks, block_size, Hk,
    head_dim] of one layout, slots [M]): the rotated k and the v also written at the rows' slots (`store_kv`)."""
    _check(x, weight, bias)
    q_cols, k_cols = num_heads * head_dim, num_kv_heads * head_dim
    if weight.shape[0] != q_cols + 2 * k_cols or head_dim % 2:
        raise ValueError(f"gemv_rope needs an even head_dim and {num_heads} + 2 x {num_kv_heads} heads of {head_dim} "
                         f"outputs, got a weight [{weight.shape[0]}, {weight.shape[1]}]")
    if cos.shape != (x.shape[0], 1, head_dim) or sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"gemv_rope needs cos and sin [{x.shape[0]}, 1, {head_dim}] with a unit last stride")
    flat_store = None
    if store is not None:
        k_cache, v_cache, slots = store
        k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        if k_flat.stride() != v_flat.stride() or k_flat.stride(-1) != 1 or k_cache.dtype != x.dtype \
                or v_cache.dtype != x.dtype:
            raise ValueError("gemv_rope's store needs caches of one layout, a unit last stride and x's dtype")
        flat_store = (k_flat, v_flat, slots)
    return _launch(x, weight, bias, None, None, 4, 1, pdl, _Rope(cos, sin, head_dim, q_cols, k_cols, flat_store))


class _Rope(NamedTuple):
    """gemv_rope's epilogue: cos / sin [M, 1, head_dim], the q and k columns, and where k and v go (caches viewed
    [slots, Hk, head_dim] and the rows' slots), if anywhere."""

    cos: torch.Tensor
    sin: torch.Tensor
    head_dim: int
    q_cols: int
    k_cols: int
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def gemv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, pdl: bool = False
              ) -> torch.Tensor:
    """silu(gate) * up [M, N / 2] of the gate/up projection x @ weight^T (+ bias) = [gate | up] [M, N], as `gemv` then
    `triton_fused.silu_and_mul` would make it: the activation in the GEMV's epilogue, one launch fewer."""
    _check(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_silu needs an even number of outputs (gate then up), got {weight.shape[0]}")
    return _launch(x, weight, bias, None, None, 4, 1, pdl, silu=True)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must match, bias [N]")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int | None,
            block_k: int | None, num_warps: int, num_stages: int, pdl: bool, rope: _Rope | None = None,
            silu: bool = False) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    default_n, default_k = gemv_tiles(n, k)
    block_n, block_k = block_n or default_n, block_k or default_k
    out = torch.empty(m, n // 2 if silu else n, dtype=x.dtype, device=x.device)
    pdl = pdl and dependent_launch.supported(x.device)
    store = rope is not None and rope.store is not None
    cos, sin = (rope.cos, rope.sin) if rope is not None else (x, x)  # unused pointers without the epilogue
    k_cache, v_cache, slots = rope.store if store else (x, x, x)
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        cos, sin, slots, k_cache, v_cache, cos.stride(0), sin.stride(0), slots.stride(0) if store else 0,
        k_cache.stride(0) if store else 0, k_cache.stride(1) if store else 0,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, ROWS=next_power_of_2(m), PDL=pdl,
        ROPE=rope is not None, HEAD_DIM=rope.head_dim if rope else 2, Q_COLS=rope.q_cols if rope else 0,
        K_COLS=rope.k_cols if rope else 0, STORE=store, SILU=silu,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False, launch_pdl=pdl,
    )
    return out
