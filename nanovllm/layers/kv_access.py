"""KV access: how one step's attention layers reach their KV, wherever it lives.

The model calls `KVAccess.attend(layer, q, k, v, scale)` once per layer, in order; that is the only
way it touches the KV cache. Each implementation is one strategy: `DeviceKV` here (every block in the
device pool), and in engine/offload/ the strategies for KV partly in pinned host memory (one pass over
a ring slot, host pieces merged by log-sum-exp, copies staged inside CUDA graphs). Every strategy
first stores the new K/V through `PagedKVCache.write` (the one KV-write point, with its hooks), then
asks the step's block selector which blocks each KV head attends to.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.block_selector import (BlockSelector, DecodeLayout, DenseSelector, Selection, SelectionInput,
                                            SparseStats, with_query_blocks)

if TYPE_CHECKING:
    from nanovllm.engine.kv_cache import PagedKVCache


class KVAccess(ABC):
    """One step's KV for every layer."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store this layer's new k, v [T, Hk, D]; return attention of q [T, Hq, D] over the step's KV."""


class DeviceKV(KVAccess):
    """Every block in the device pool: the backend's paged attention over the step's block tables."""

    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 selector: BlockSelector | None = None, stats: SparseStats | None = None):
        self.cache, self.backend, self.meta = cache, backend, meta
        self.selector, self.stats = selector or DenseSelector(), stats
        self.layout: DecodeLayout | None = None

    def _layout(self, batch: SelectionInput) -> DecodeLayout:
        if self.layout is None:
            self.layout = DecodeLayout.build(batch, self.cache.data.device)
        return self.layout

    def attend(self, layer, q, k, v, scale):
        self.cache.write(layer, k, v, self.meta.slot_mapping)
        k_cache, v_cache = self.cache.layer(layer)
        if self.selector.dense:
            return self.backend.forward(q, k_cache, v_cache, self.meta, scale)
        batch = SelectionInput(self.meta.query_lens, self.meta.seq_lens, self.meta.block_size, self.meta.block_tables,
                               stats=self.stats)
        selection = select_for_step(self.selector, layer, q, k_cache.shape[2], batch, self._layout)
        if selection is None:
            return self.backend.forward(q, k_cache, v_cache, self.meta, scale)
        if isinstance(selection, DeviceSelection):
            return self.backend.forward(q, k_cache, v_cache, decode_metadata(self.backend, selection), scale)
        groups = query_groups(batch, selection)
        ids = groups.pool_ids([torch.tensor(t, dtype=torch.int64) for t in batch.block_tables])
        meta = group_metadata(self.backend, groups, ids, self.meta.block_size, q.device)
        return self.backend.forward(q, k_cache, v_cache, meta, scale)


@dataclass
class DeviceSelection:
    """A decode step's selection made on the device: keep [B, Hk, blocks] over layout's blocks, and the
    most blocks any KV head keeps (the tables' width, known on the host)."""

    layout: DecodeLayout
    keep: torch.Tensor
    widest: int


def select_for_step(selector: BlockSelector, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput,
                    layout_of: Callable[[SelectionInput], DecodeLayout],
                    bytes_per_host_pair: int = 0) -> Selection | DeviceSelection | None:
    """Decode steps go to the selector's device-side selection where it has one (no host sync per layer);
    other steps, and selectors without it, to select_blocks. Counts go to batch.stats either way."""
    if max(batch.query_lens) == 1:
        layout = layout_of(batch)
        chosen = selector.decode_keep(layer, q, num_kv_heads, layout)
        if chosen is not NotImplemented:
            if chosen is None:
                if batch.stats is not None:
                    batch.stats.add(batch, None, num_kv_heads)
                return None
            keep, widest = chosen
            if batch.stats is not None:
                batch.stats.add_decode_on_device(layout, keep, bytes_per_host_pair)
            return DeviceSelection(layout, keep, widest)
    return select_blocks(selector, layer, q, num_kv_heads, batch)


def decode_metadata(backend: AttentionBackend, selection: DeviceSelection) -> AttentionMetadata:
    """Per-KV-head decode metadata from a device selection, built on the device: each head's kept blocks in
    position order (the most recent last, the dropped ones full and before it)."""
    layout, block_size = selection.layout, selection.layout.batch.block_size
    tables, lengths = head_tables(layout, selection.keep, selection.widest, block_size)
    return backend.build_head_metadata([1] * tables.shape[0], lengths, tables, block_size, tables.device,
                                       max_seq_lens=layout.batch.seq_lens)


def head_tables(layout: DecodeLayout, keep: torch.Tensor, width: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and KV head, the kept blocks of keep [B, Hk, blocks] in position order as kernel table
    entries [B, Hk, width] (padded with -1), and the KV length they hold [B, Hk] (the dropped blocks are
    full and precede the most recent one, which is kept). Tensor operations of fixed shapes only (no
    sort): each kept block goes to its rank among the kept ones, the dropped ones to a spare column."""
    rank = keep.cumsum(-1) - 1
    target = torch.where(keep & (rank < width), rank, width)
    tables = torch.full((*keep.shape[:2], width + 1), -1, dtype=layout.ids.dtype, device=keep.device)
    tables.scatter_(-1, target, layout.ids[:, None, :].expand_as(keep))
    tables = tables[..., :width].contiguous()
    kept = keep.sum(-1)  # [B, Hk]
    lengths = layout.seq_lens[:, None] - (layout.valid.sum(1, keepdim=True) - kept) * block_size
    return tables, lengths


def select_blocks(selector: BlockSelector, layer: int, q: torch.Tensor, num_kv_heads: int,
                  batch: SelectionInput) -> Selection | None:
    """The selector's masks with the query blocks forced on; None for every block (dense). The attended
    share is counted in batch.stats."""
    if selector.dense:
        return None
    selection = selector.select(layer, q, num_kv_heads, batch)
    if selection is not None and all(m is None for m in selection):
        selection = None
    selection = None if selection is None else with_query_blocks(selection, batch)
    if batch.stats is not None:
        batch.stats.add(batch, selection, num_kv_heads)
    return selection


@dataclass
class QueryGroups:
    """The step's query rows, in order, as groups of consecutive rows of one sequence that attend to the
    same blocks: group g is `count[g]` rows of sequence `seq[g]`, causal over its first end[g] positions;
    mask[g, head, c]: block c of the sequence attended (False past the group's ceil(end / block_size)
    visible blocks)."""

    seq: list[int]
    count: list[int]
    ends: list[int]  # end of each group, on the host
    end: torch.Tensor  # [G] int64, the same on the mask's device
    visible: torch.Tensor  # [G] int64, blocks up to end
    mask: torch.Tensor  # [G, Hk, max blocks] bool

    def visible_blocks(self, block_size: int) -> list[int]:
        return [-(-e // block_size) for e in self.ends]

    def pool_ids(self, per_sequence: list[torch.Tensor]) -> torch.Tensor:
        """[G, max blocks]: each group's row of per_sequence[seq] (block c -> id in a pool, -1: not there)."""
        ids = torch.full((len(per_sequence), self.mask.shape[-1]), -1, dtype=torch.int64)
        for i, row in enumerate(per_sequence):
            ids[i, : row.numel()] = row[: self.mask.shape[-1]]
        return ids[torch.tensor(self.seq, dtype=torch.int64)].to(self.mask.device, non_blocking=True)


def query_groups(batch: SelectionInput, selection: Selection) -> QueryGroups:
    """One group per sequence for a [Hk, blocks] mask or None (every block), one per query block for
    [Hk, query blocks, blocks]. The None rows (decode rows beside a sparse prefill, say) cost no tensor
    operation each: they are switched on together."""
    masked = [m for m in selection if m is not None]
    num_kv_heads, device = masked[0].shape[0], masked[0].device
    width = max(batch.num_blocks(i) for i in range(len(selection)))
    seqs, counts, ends, masks, whole = [], [], [], [], []  # whole: (group, blocks) of None rows
    for i, mask in enumerate(selection):
        count, end, bs = batch.query_lens[i], batch.seq_lens[i], batch.block_size
        if mask is None or mask.dim() == 2:
            if mask is None:
                whole.append((len(seqs), batch.num_blocks(i)))
            else:
                masks.append((len(seqs), mask[None].to(device)))
            seqs.append(i)
            counts.append(count)
            ends.append(end)
            continue
        first, num_rows = batch.first_query_block(i), mask.shape[1]
        upper = torch.clamp((first + torch.arange(1, num_rows + 1)) * bs, max=end)
        lower = torch.clamp((first + torch.arange(num_rows)) * bs, min=end - count)
        causal = torch.arange(mask.shape[-1], device=device)[None, :] <= \
            (first + torch.arange(num_rows, device=device))[:, None]
        masks.append((len(seqs), mask.to(device).transpose(0, 1) & causal[:, None, :]))
        seqs += [i] * num_rows
        counts += (upper - lower).tolist()
        ends += upper.tolist()
    padded = torch.zeros(len(seqs), num_kv_heads, width, dtype=torch.bool, device=device)
    for row, m in masks:
        padded[row : row + m.shape[0], :, : m.shape[-1]] = m
    if whole:
        rows, blocks = (torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True) for x in zip(*whole))
        padded[rows] = (torch.arange(width, device=device)[None, :] < blocks[:, None])[:, None, :]
    end = torch.tensor(ends, dtype=torch.int64).to(device, non_blocking=True)
    return QueryGroups(seqs, counts, ends, end, -(-end // batch.block_size), padded)


def group_metadata(backend: AttentionBackend, groups: QueryGroups, pool_ids: torch.Tensor, block_size: int,
                   device: torch.device, causal: bool = True) -> AttentionMetadata:
    """Per-KV-head metadata, one "sequence" per group, over the blocks each head attends that pool_ids
    [G, blocks] names in the pool at hand (-1: not in that pool). causal: dropped blocks are full and
    precede the group's queries, so compacting them away keeps the mask right; else the kept blocks are
    history. Built with tensor operations (no loop over blocks) and without a sync: the tables' width and
    the lengths' bounds come from the groups' ends, known on the host."""
    keep = groups.mask & (pool_ids >= 0)[:, None, :]
    kept = keep.sum(-1)  # [G, Hk]
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices  # kept blocks first, in order
    visible = groups.visible_blocks(block_size)
    width = max(1, min(keep.shape[-1], max(visible, default=1)))
    tables = pool_ids[:, None, :].expand_as(keep).gather(-1, order[..., :width])
    tables = torch.where(torch.arange(width, device=keep.device) < kept[..., None], tables, -1)
    if causal:
        lengths, bounds = groups.end[:, None] - (groups.visible[:, None] - kept) * block_size, groups.ends
    else:
        lengths, bounds = kept * block_size, [v * block_size for v in visible]
    return backend.build_head_metadata(groups.count, lengths, tables, block_size, device, max_seq_lens=bounds)
