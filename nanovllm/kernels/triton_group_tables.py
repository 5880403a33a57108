"""A block-sparse prefill's per-layer tables in one Triton kernel (kv_access.group_metadata).

From the query groups' masks [G, Hk, C] (block c of the group's sequence attended by a KV head) and the blocks'
ids in the pool at hand [G, C] (-1: not there), one program per group writes each KV head's kept blocks' ids in
position order [G, Hk, W] (-1 padded) and the KV length they hold [G, Hk] (int32): the kept blocks' tokens, plus
`short` [G] where the group is causal (its last block is partly filled). The same numbers as the PyTorch path in
`group_metadata` (a mask, a count, a stable sort of the kept flags, a where and a gather: a dozen small kernels per
layer); a running count over the columns gives each kept block its place instead of the sort.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.sizes import next_power_of_2
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()


@triton.jit(do_not_specialize=["num_columns", "width", "block_size", "stride_mg", "stride_mh", "stride_ig",
                               "stride_tg", "stride_th", "stride_lg"])  # sizes vary by step
def _group_tables_kernel(
    mask_ptr, ids_ptr, short_ptr, tables_ptr, lengths_ptr, num_heads, num_columns, width, block_size,
    stride_mg, stride_mh, stride_ig, stride_tg, stride_th, stride_lg,
    HEADS_PAD: tl.constexpr, BLOCK_C: tl.constexpr, CAUSAL: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, BLOCK_C)
    head_ok = heads < num_heads
    placed = tl.zeros([HEADS_PAD], tl.int32)  # kept blocks so far per head
    tables = tables_ptr + group * stride_tg + heads[:, None] * stride_th
    for start in range(0, num_columns, BLOCK_C):
        c = start + cols
        ids = tl.load(ids_ptr + group * stride_ig + c, mask=c < num_columns, other=-1)
        inside = head_ok[:, None] & (c < num_columns)[None, :]
        attended = tl.load(mask_ptr + group * stride_mg + heads[:, None] * stride_mh + c[None, :], mask=inside,
                           other=0)
        keep = (attended != 0) & (ids >= 0)[None, :]
        rank = placed[:, None] + tl.cumsum(keep.to(tl.int32), axis=1) - 1
        tl.store(tables + rank, tl.broadcast_to(ids[None, :], [HEADS_PAD, BLOCK_C]), mask=keep & (rank < width))
        placed += tl.sum(keep.to(tl.int32), axis=1)
    for start in range(0, width, BLOCK_C):  # the padding after each head's kept blocks
        c = start + cols
        tl.store(tables + c[None, :], tl.full([HEADS_PAD, BLOCK_C], -1, tl.int64),
                 mask=head_ok[:, None] & (c[None, :] >= placed[:, None]) & (c < width)[None, :])
    lengths = placed * block_size
    if CAUSAL:
        lengths += tl.load(short_ptr + group).to(tl.int32)
    tl.store(lengths_ptr + group * stride_lg + heads, lengths, mask=head_ok)


def group_tables(mask: torch.Tensor, ids: torch.Tensor, short: torch.Tensor | None, width: int, block_size: int,
                 block_columns: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(tables [G, Hk, width] int64, lengths [G, Hk] int32) of mask [G, Hk, C] bool over ids [G, C] int64;
    short [G] int64 (added to the lengths: a causal group's partly filled last block), or None. Every group keeps
    at most `width` blocks (the caller's bound). block_columns: columns a loop step reads (one kernel variant for
    every length)."""
    groups, heads, columns = mask.shape
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    ids = ids.to(torch.int64) if ids.stride(-1) == 1 else ids.to(torch.int64).contiguous()
    tables = torch.empty(groups, heads, width, dtype=torch.int64, device=mask.device)
    lengths = torch.empty(groups, heads, dtype=torch.int32, device=mask.device)
    _group_tables_kernel[(groups,)](
        mask, ids, tables if short is None else short, tables, lengths, heads, columns, width, block_size,
        mask.stride(0), mask.stride(1), ids.stride(0), tables.stride(0), tables.stride(1), lengths.stride(0),
        HEADS_PAD=next_power_of_2(heads), BLOCK_C=block_columns,
        CAUSAL=short is not None, num_warps=4,
    )
    return tables, lengths
