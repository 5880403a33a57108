"""Long prefill chunks through cuDNN's fused attention (torch's SDPA cuDNN operator, with its log-sum-exp).

A chunk of L new tokens at the end of a sequence's S keys (already stored in the paged cache) is
attended piece by piece: the keys before the chunk in pieces of at most PIECE tokens, without a mask,
then the chunk's own L keys with cuDNN's causal mask (aligned top-left, which is the right one for a
square piece; a chunk over a prefix therefore cannot be a single call). Each piece's keys are gathered
from the paged cache and repeated over the query heads of their KV-head group; the pieces merge by
log-sum-exp in float32 and the result is rounded to the query's dtype once. `paged_attention_reference`
is the definition; `attend_reference` stands in for cuDNN in the CPU tests of the gathering and merging.
"""
from __future__ import annotations

from typing import Callable

import torch

from nanovllm.kernels.reference import _sequence_attention, merge_attention_states

PIECE = 16384  # keys per call: bounds the gathered copies at 2 x PIECE x Hq x D elements
MIN_QUERY = 1024  # shorter chunks stay on the Triton kernel (one call per sequence and piece)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]]


def attend_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, H, D], k/v [S, H, D] (S == L when causal) -> (out [L, H, D], lse [L, H] float32)."""
    heads, queries = q.shape[1], q.shape[0]
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, 0.0, causal, False,
        scale=scale)[:2]
    return out[0].transpose(0, 1), lse.reshape(heads, queries).transpose(0, 1).float()


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _sequence_attention(q.float(), k.float(), v.float(), scale, causal)
    return out.to(q.dtype), lse


def usable(q: torch.Tensor, query_lens: list[int], block_tables: torch.Tensor) -> bool:
    """Every sequence prefills a long chunk (no one-token rows), half precision on CUDA, shared tables."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and block_tables.dim() == 2
            and q.shape[-1] in (64, 128) and min(query_lens) >= MIN_QUERY)


def gathered_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_lens: list[int], seq_lens: list[int],
    block_tables: torch.Tensor, scale: float, attend: Attend | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sequence's new tokens over its cached keys and themselves, as the Triton
    prefill kernel computes it: returns (out [T, Hq, D], lse [T, Hq] float32), written into `out` if given."""
    attend = attend or attend_cudnn
    result, lse = out or (torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for i, (n, s) in enumerate(zip(query_lens, seq_lens)):
        rows = slice(start, start + n)
        pieces = [(lo, min(lo + PIECE, s - n), False) for lo in range(0, s - n, PIECE)] + [(s - n, s, True)]
        acc = acc_lse = None
        for lo, hi, causal in pieces:
            keys = _gather_range(k_cache, block_tables[i], lo, hi).repeat_interleave(group, dim=1)
            values = _gather_range(v_cache, block_tables[i], lo, hi).repeat_interleave(group, dim=1)
            piece, piece_lse = attend(q[rows], keys, values, scale, causal)
            if acc is None:
                acc, acc_lse = piece.float(), piece_lse
            else:
                acc, acc_lse = merge_attention_states(acc, acc_lse, piece, piece_lse)
        result[rows] = acc.to(q.dtype)
        lse[rows] = acc_lse
        start += n
    return result, lse


def _gather_range(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Tokens lo..hi of one sequence as a contiguous [hi - lo, Hk, D] tensor."""
    block_size = cache.shape[1]
    first, last = lo // block_size, -(-hi // block_size)
    blocks = cache.index_select(0, table[first:last].to(torch.int64))
    return blocks.flatten(0, 1)[lo - first * block_size: hi - first * block_size]
