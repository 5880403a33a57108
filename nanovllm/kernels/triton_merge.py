"""One pass that merges two partial attention results by log-sum-exp (`reference.merge_attention_states`
defines it): out = (out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse)), lse = log(e^lse_a + e^lse_b).
Inputs may be strided views (e.g. cuDNN's [1, H, T, D] result seen as [T, H, D]); the merged rows are
written contiguous. The PyTorch expression is five elementwise passes over float32 copies: on the
cuDNN prefill route (layers/cudnn_prefill.py) it cost 0.4-0.5 ms per layer at an 8K chunk on the H200,
this kernel reads each input once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.sizes import cdiv
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()


@triton.jit(do_not_specialize=["num_rows"])  # a chunk's rows: a prompt's last chunk is any length
def _merge_two_kernel(
    a_ptr, la_ptr, b_ptr, lb_ptr, out_ptr, lse_ptr, num_rows,
    s_at, s_ah, s_lat, s_lah, s_bt, s_bh, s_lbt, s_lbh, s_ot, s_oh, s_lt, s_lh,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):
    head = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < num_rows
    rows64 = rows.to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    la = tl.load(la_ptr + rows64 * s_lat + head * s_lah, mask=valid, other=0.0).to(tl.float32)
    lb = tl.load(lb_ptr + rows64 * s_lbt + head * s_lbh, mask=valid, other=0.0).to(tl.float32)
    peak = tl.maximum(la, lb)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # both parts empty: out 0, lse -inf
    wa = tl.exp2((la - peak) * 1.4426950408889634)
    wb = tl.exp2((lb - peak) * 1.4426950408889634)
    total = wa + wb
    mask = valid[:, None]
    a = tl.load(a_ptr + rows64[:, None] * s_at + head * s_ah + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows64[:, None] * s_bt + head * s_bh + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.where(wa[:, None] > 0, a * wa[:, None], 0.0)  # an empty part's out is ignored, even NaN
    b = tl.where(wb[:, None] > 0, b * wb[:, None], 0.0)
    merged = (a + b) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + rows64[:, None] * s_ot + head * s_oh + dims[None, :], merged.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(lse_ptr + rows64 * s_lt + head * s_lh, peak + tl.log(total), mask=valid)


def merge_two_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D] contiguous in out_a's dtype, lse [T, H] float32) of two parts out_* [T, H, D] (last
    dimension contiguous, D a power of two) and lse_* [T, H] (natural log, -inf for a part without keys)."""
    num_rows, num_heads, head_dim = out_a.shape
    if out_b.shape != out_a.shape or lse_a.shape != (num_rows, num_heads) or lse_b.shape != lse_a.shape:
        raise ValueError(f"parts must be [T, H, D] and [T, H]: {tuple(out_a.shape)}, {tuple(lse_a.shape)}, "
                         f"{tuple(out_b.shape)}, {tuple(lse_b.shape)}")
    if out_a.stride(-1) != 1 or out_b.stride(-1) != 1 or head_dim & (head_dim - 1):
        raise ValueError("head_dim must be a power of two with contiguous rows")
    out = torch.empty(num_rows, num_heads, head_dim, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(num_rows, num_heads, dtype=torch.float32, device=out_a.device)
    rows = max(1, 4096 // head_dim)
    _merge_two_kernel[(cdiv(num_rows, rows), num_heads)](
        out_a, lse_a, out_b, lse_b, out, lse, num_rows,
        *out_a.stride()[:2], *lse_a.stride(), *out_b.stride()[:2], *lse_b.stride(), *out.stride()[:2], *lse.stride(),
        HEAD_DIM=head_dim, ROWS=rows, num_warps=4,
    )
    return out, lse
