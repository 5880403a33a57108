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
        batch = SelectionInput(self.meta.query_lens, self.meta.seq_lens, self.meta.block_size, self.meta.block_tables)
        selection = select_blocks(self.selector, layer, q, k_cache.shape[2], batch, self.stats)
        if selection is None:
            return self.backend.forward(q, k_cache, v_cache, self.meta, scale)
        out = torch.empty_like(q)
        for head, meta in enumerate(per_head_metadata(self.backend, self.meta, self.meta.block_tables, selection)):
            rows = head_rows(q, k_cache.shape[2], head)
            out[:, rows] = self.backend.forward(q[:, rows].contiguous(), k_cache[:, :, head : head + 1],
                                                v_cache[:, :, head : head + 1], meta, scale)
        return out


def select_blocks(selector: BlockSelector, layer: int, q: torch.Tensor, num_kv_heads: int,
                  batch: SelectionInput, stats: SparseStats | None = None) -> Selection | None:
    """The selector's masks with the query blocks forced on; None for every block (dense). stats: where
    the attended share is counted."""
    if selector.dense:
        return None
    selection = selector.select(layer, q, num_kv_heads, batch)
    selection = None if selection is None else with_query_blocks(selection, batch)
    if stats is not None:
        stats.add(batch, selection, num_kv_heads)
    return selection


def head_rows(q: torch.Tensor, num_kv_heads: int, head: int) -> slice:
    """The query heads of KV head `head` (grouped-query attention)."""
    group = q.shape[1] // num_kv_heads
    return slice(head * group, (head + 1) * group)


def per_head_metadata(backend: AttentionBackend, meta: AttentionMetadata, tables: list[list[int]],
                      selection: Selection) -> list[AttentionMetadata]:
    """Per KV head, metadata over the selected blocks only: compacted tables and lengths. Dropped blocks
    are full and precede every query, so the causal mask stays right. tables: each sequence's blocks in
    position order (ids in the pool that the metadata will be used with)."""
    bs = meta.block_size
    num_heads = selection[0].shape[0] if selection else 0
    masks = [m.tolist() for m in selection]
    result = []
    for head in range(num_heads):
        kept_tables, kept_lens = [], []
        for table, mask, seq_len in zip(tables, masks, meta.seq_lens):
            kept = [b for b, keep in zip(table, mask[head]) if keep]
            kept_tables.append(kept)
            kept_lens.append(seq_len - (len(mask[head]) - len(kept)) * bs)
        result.append(backend.build_metadata(meta.query_lens, kept_lens, kept_tables, [], bs,
                                             meta.cu_query_lens.device))
    return result
