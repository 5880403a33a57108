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
from nanovllm.layers.block_selector import (BlockSelector, DenseSelector, Selection, SelectionInput, SparseStats,
                                            with_query_blocks)

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

    def attend(self, layer, q, k, v, scale):
        self.cache.write(layer, k, v, self.meta.slot_mapping)
        k_cache, v_cache = self.cache.layer(layer)
        if self.selector.dense:
            return self.backend.forward(q, k_cache, v_cache, self.meta, scale)
        batch = SelectionInput(self.meta.query_lens, self.meta.seq_lens, self.meta.block_size, self.meta.block_tables,
                               stats=self.stats)
        selection = select_blocks(self.selector, layer, q, k_cache.shape[2], batch)
        if selection is None:
            return self.backend.forward(q, k_cache, v_cache, self.meta, scale)
        meta = group_metadata(self.backend, query_groups(batch, selection), k_cache.shape[2],
                              lambda g, c: batch.block_tables[g.seq][c], self.meta.block_size, q.device)
        return self.backend.forward(q, k_cache, v_cache, meta, scale)


def select_blocks(selector: BlockSelector, layer: int, q: torch.Tensor, num_kv_heads: int,
                  batch: SelectionInput) -> Selection | None:
    """The selector's masks with the query blocks forced on; None for every block (dense). The attended
    share is counted in batch.stats."""
    if selector.dense:
        return None
    selection = selector.select(layer, q, num_kv_heads, batch)
    selection = None if selection is None else with_query_blocks(selection, batch)
    if batch.stats is not None:
        batch.stats.add(batch, selection, num_kv_heads)
    return selection


@dataclass
class QueryGroup:
    """Consecutive query rows of one sequence that attend to the same blocks: rows [start, start + count)
    of the step, causal over the sequence's first `end` positions; mask[head][c]: block c attended."""

    seq: int
    start: int
    count: int
    end: int
    mask: list[list[bool]]


def query_groups(batch: SelectionInput, selection: Selection) -> list[QueryGroup]:
    """The step's query rows, in order, as groups: one per sequence for a [Hk, blocks] mask, one per query
    block for a [Hk, query blocks, blocks] mask."""
    groups, row, bs = [], 0, batch.block_size
    for i, mask in enumerate(selection):
        count, end = batch.query_lens[i], batch.seq_lens[i]
        if mask.dim() == 2:
            groups.append(QueryGroup(i, row, count, end, mask.tolist()))
        else:
            first = batch.first_query_block(i)
            for g in range(mask.shape[1]):
                lo, hi = max(end - count, (first + g) * bs), min(end, (first + g + 1) * bs)
                groups.append(QueryGroup(i, row + lo - (end - count), hi - lo, hi, mask[:, g, : first + g + 1].tolist()))
        row += count
    return groups


def group_metadata(backend: AttentionBackend, groups: list[QueryGroup], num_kv_heads: int,
                   block_of: Callable[[QueryGroup, int], int | None], block_size: int, device: torch.device,
                   causal: bool = True) -> AttentionMetadata:
    """Per-KV-head metadata, one "sequence" per group, over the blocks each head attends that block_of
    names in the pool at hand (None: not in that pool). causal: dropped blocks are full and precede the
    group's queries, so compacting them away keeps the mask right; else the kept blocks are history."""
    query_lens, seq_lens, tables = [], [], []
    for g in groups:
        query_lens.append(g.count)
        head_tables, head_lens = [], []
        for mask in g.mask[:num_kv_heads]:
            kept = [x for c, keep in enumerate(mask) if keep and (x := block_of(g, c)) is not None]
            head_tables.append(kept)
            head_lens.append(g.end - (len(mask) - len(kept)) * block_size if causal else len(kept) * block_size)
        tables.append(head_tables)
        seq_lens.append(head_lens)
    return backend.build_head_metadata(query_lens, seq_lens, tables, block_size, device)
