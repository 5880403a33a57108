"""Pure-PyTorch paged attention in float32: the definition the Triton kernels are tested against.

Layout (shared with the kernels):
  q            [T, Hq, D]   new tokens of all sequences, flattened; sequence i owns rows
                            cu_query_lens[i] : cu_query_lens[i + 1]
  k/v_cache    [num_blocks, block_size, Hk, D], Hq a multiple of Hk (grouped-query attention)
  seq_lens     [B]          tokens of KV per sequence, the new ones included (they are its last ones)
  block_tables [B, max_blocks] block ids per sequence, padded (with -1 or anything) past its blocks

New token j of sequence i sits at position seq_lens[i] - query_len_i + j and sees the keys at
positions <= its own. Results are (out [T, Hq, D] in q.dtype, lse [T, Hq] float32), where lse is the
natural-log log-sum-exp of the scaled scores of each row: the handle `merge_attention_states` needs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class KeyCodes(NamedTuple):
    """Keys as int8 codes [blocks, block_size, Hk, D] and float32 scales [blocks, block_size, Hk] in a pool's
    block layout, k ~ codes * scales (Quest's on-device key copy of the host blocks, BlockKeyCopy)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """The keys [len(ids), block_size, Hk, D] float32 of these blocks (int64 ids on the codes' device)."""
        return self.codes.index_select(0, ids).float() * self.scales.index_select(0, ids)[..., None]

    def head(self, one: slice) -> KeyCodes:
        return KeyCodes(self.codes[:, :, one], self.scales[:, :, one])


class HostKV(NamedTuple):
    """One layer's KV blocks outside the device cache (an offload ring slot, or pinned host memory):
    block-table entries >= base name block (entry - base) of k/v, which have the cache's block shape.
    key_codes: those blocks' keys read from this on-device copy instead of k (only v then crosses PCIe)."""

    k: torch.Tensor
    v: torch.Tensor
    base: int
    key_codes: KeyCodes | None = None

    @property
    def keys(self) -> torch.Tensor | KeyCodes:
        """Where attention reads the host blocks' keys: k, or their codes when given."""
        return self.k if self.key_codes is None else self.key_codes


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
    host_kv: HostKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every new token over its sequence's cached and new keys, computed in float32.
    causal=False: every new token sees all seq_lens[i] keys (history preceding the queries); rows of
    sequences with seq_len 0 then get out 0 and lse -inf. host_kv: blocks some tables name in host memory.
    Per-KV-head selections: block_tables [B, Hk, max_blocks] and seq_lens [B, Hk], each KV head (with its
    query heads) over its own blocks, the dropped ones preceding the queries."""
    if block_tables.dim() == 3:
        return _per_head_reference(q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables, scale, causal, host_kv)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    starts = cu_query_lens.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start or seq_len == 0:
            continue
        base = host_kv and host_kv.base
        keys = gather_tokens(k_cache, block_tables[i], seq_len, host_kv and host_kv.keys, base).float()
        values = gather_tokens(v_cache, block_tables[i], seq_len, host_kv and host_kv.v, base).float()
        out_i, lse_i = _sequence_attention(q[start:end].float(), keys, values, scale, causal)
        out[start:end] = out_i.to(q.dtype)
        lse[start:end] = lse_i
    return out, lse


def _per_head_reference(q, k_cache, v_cache, cu_query_lens, seq_lens, block_tables, scale, causal, host_kv):
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for head in range(k_cache.shape[2]):
        rows, one = slice(head * group, (head + 1) * group), slice(head, head + 1)
        head_host = host_kv and HostKV(host_kv.k[:, :, one], host_kv.v[:, :, one], host_kv.base,
                                       host_kv.key_codes and host_kv.key_codes.head(one))
        out[:, rows], lse[:, rows] = paged_attention_reference(
            q[:, rows], k_cache[:, :, one], v_cache[:, :, one], cu_query_lens, seq_lens[:, head],
            block_tables[:, head], scale, causal, head_host)
    return out, lse


def gather_tokens(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                  host_cache: torch.Tensor | KeyCodes | None = None, host_base: int | None = None) -> torch.Tensor:
    """The first seq_len tokens of one sequence as a contiguous [seq_len, Hk, D] tensor on cache's device;
    with host_cache, table entries >= host_base are read from it (key codes: dequantized, float32)."""
    num_blocks = -(-seq_len // cache.shape[1])
    blocks = block_table[:num_blocks].to(dtype=torch.int64)
    if host_cache is None:
        flat = cache.view(cache.shape[0], -1) if cache.is_contiguous() else cache  # 2-D: torch's faster path
        gathered = flat.index_select(0, blocks.to(cache.device)).view(-1, *cache.shape[1:])
    else:
        on_host = blocks >= host_base
        device_part = cache.index_select(0, torch.where(on_host, 0, blocks).to(cache.device))
        host_ids = torch.where(on_host, blocks - host_base, 0)
        if isinstance(host_cache, KeyCodes):
            host_part = host_cache.blocks(host_ids.to(host_cache.codes.device))
        else:
            host_part = host_cache.index_select(0, host_ids.to(host_cache.device))
        gathered = torch.where(on_host.to(cache.device)[:, None, None, None], host_part.to(cache.device), device_part)
    return gathered.flatten(0, 1)[:seq_len]


def _sequence_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D] are the last n of the seq_len = len(keys) positions; returns ([n, Hq, D], [n, Hq])."""
    n, num_heads = q.shape[:2]
    seq_len, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
    visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
    if causal:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, values)
    return out, lse.transpose(0, 1)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    out_*: [..., D] each normalised over its own keys; lse_*: [...] their natural-log log-sum-exps
    (-inf for a part without keys; that part's out is ignored, even if it is NaN). Computed in
    float32; returns (out in out_a.dtype, lse float32). Rows where both parts are empty give
    out 0 and lse -inf.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    peak = torch.maximum(lse_a, lse_b)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)  # both empty: avoid -inf - -inf
    weight_a = torch.exp(lse_a - peak)
    weight_b = torch.exp(lse_b - peak)
    total = weight_a + weight_b
    part_a = torch.where(weight_a[..., None] > 0, out_a.float() * weight_a[..., None], 0.0)
    part_b = torch.where(weight_b[..., None] > 0, out_b.float() * weight_b[..., None], 0.0)
    out = (part_a + part_b) / torch.where(total > 0, total, 1.0)[..., None]
    return out.to(out_a.dtype), peak + torch.log(total)

