"""Block selection: which KV blocks each KV head attends to, per layer and step.

Every KV-access strategy (layers/kv_access.py, engine/offload/) asks the step's selector before it
copies or attends. A selector sees the layer, the step's queries and each sequence's blocks and
returns, per sequence, a bool mask over the sequence's blocks in position order, [num_kv_heads,
num_blocks] for all its query rows or [num_kv_heads, query blocks, num_blocks] per block of query
rows (prefill), or None for "every block" (the dense fast path). Blocks that hold the queries are
always attended to, whatever the mask says, so a selector only narrows the history that precedes
them, and the causal mask stays right when the rest is dropped.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionInput:
    """What a selector may look at besides the queries: per sequence, its new tokens (query rows
    cu_query_lens[i]:cu_query_lens[i+1] of q), its KV length after the step, and its blocks in position
    order (ids within their pool; on_host says which pool, None: all on the device)."""

    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    block_tables: list[list[int]]
    on_host: list[list[bool]] | None = None
    stats: SparseStats | None = None  # where a selector counts host KV it reads for its estimate

    def num_blocks(self, i: int) -> int:
        return -(-self.seq_lens[i] // self.block_size)

    def first_query_block(self, i: int) -> int:
        """The first block holding one of sequence i's new tokens (blocks before it precede every query)."""
        return (self.seq_lens[i] - self.query_lens[i]) // self.block_size

    def query_rows(self, i: int) -> slice:
        start = sum(self.query_lens[:i])
        return slice(start, start + self.query_lens[i])


Selection = list[torch.Tensor]  # per sequence: bool [Hk, blocks] or [Hk, query blocks, blocks], True = attend


class BlockSelector(ABC):
    name: str
    dense = False  # True: select() always returns None; strategies may then use fixed, pre-planned copies

    @abstractmethod
    def select(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput) -> Selection | None:
        """q: [T, Hq, D] this layer's queries (post-RoPE). None: every block of every sequence."""


def with_query_blocks(selection: Selection, batch: SelectionInput) -> Selection:
    """The selection with every block that holds a query token switched on (see the module docstring).
    A per-sequence mask is [Hk, blocks] (every query row) or [Hk, query blocks, blocks], one row of blocks
    per block holding queries (from first_query_block on); there only the block's own diagonal is forced."""
    masks = []
    for i, mask in enumerate(selection):
        n, first = batch.num_blocks(i), batch.first_query_block(i)
        if mask.shape[-1] != n or (mask.dim() == 3 and mask.shape[1] != n - first):
            raise ValueError(f"selection for sequence {i} has shape {tuple(mask.shape)}; it has {n} blocks, "
                             f"{n - first} of them with queries")
        mask = mask.clone()
        if mask.dim() == 2:
            mask[:, first:] = True
        else:
            mask[:, torch.arange(n - first), torch.arange(first, n)] = True
        masks.append(mask)
    return masks


class SparseStats:
    """Per sequence of one step, summed over layers and KV heads: (query block, KV block) pairs attended
    and causally visible in prefill rows, KV blocks read and present in decode rows, and host KV bytes
    copied to the device for it."""

    def __init__(self, num_seqs: int):
        self.prefill = [[0, 0] for _ in range(num_seqs)]
        self.decode = [[0, 0] for _ in range(num_seqs)]
        self.host_bytes = [0] * num_seqs

    def add(self, batch: SelectionInput, selection: Selection | None, num_kv_heads: int) -> None:
        for i in range(len(batch.seq_lens)):
            n, first = batch.num_blocks(i), batch.first_query_block(i)
            if batch.query_lens[i] == 1:
                kept = n * num_kv_heads if selection is None else int(selection[i].sum())
                self.decode[i][0] += kept
                self.decode[i][1] += n * num_kv_heads
                continue
            visible = sum(range(first + 1, n + 1)) * num_kv_heads  # query block b sees KV blocks 0..b
            self.prefill[i][0] += visible if selection is None else prefill_pairs(selection[i], first, n)
            self.prefill[i][1] += visible


def prefill_pairs(mask: torch.Tensor, first: int, n: int) -> int:
    """(query block, KV block) pairs a prefill mask attends, over the query blocks first..n-1 (block b sees
    KV blocks 0..b): a [Hk, blocks] mask is shared by every query block, [Hk, query blocks, blocks] is not."""
    columns = torch.arange(n, device=mask.device)
    if mask.dim() == 2:
        rows_seeing = (n - torch.clamp(columns, min=first)).to(torch.int64)  # query blocks >= max(c, first)
        return int((mask.to(torch.int64) * rows_seeing).sum())
    causal = columns[None, :] <= (first + torch.arange(n - first, device=mask.device))[:, None]
    return int((mask & causal).sum())


_SELECTORS: dict[str, type[BlockSelector]] = {}


def register_block_selector(name: str):
    def wrap(cls: type[BlockSelector]) -> type[BlockSelector]:
        cls.name = name
        _SELECTORS[name] = cls
        return cls

    return wrap


def get_block_selector(name: str, **options) -> BlockSelector:
    if name not in _SELECTORS:
        raise ValueError(f"unknown block selector {name!r}; available: {sorted(_SELECTORS)}")
    return _SELECTORS[name](**options)


@register_block_selector("dense")
class DenseSelector(BlockSelector):
    dense = True

    def select(self, layer, q, num_kv_heads, batch) -> None:
        return None


@register_block_selector("sink_recent")
class SinkRecentSelector(BlockSelector):
    """StreamingLLM-style: the first `sink_blocks` and the last `recent_blocks` blocks of each sequence,
    the same for every head and layer (layers < dense_layers attend to everything)."""

    def __init__(self, sink_blocks: int = 1, recent_blocks: int = 2, dense_layers: int = 0):
        if sink_blocks < 0 or recent_blocks < 1:
            raise ValueError(f"sink_blocks must be >= 0 and recent_blocks >= 1, got {sink_blocks}, {recent_blocks}")
        self.sink_blocks, self.recent_blocks, self.dense_layers = sink_blocks, recent_blocks, dense_layers

    def select(self, layer, q, num_kv_heads, batch) -> Selection | None:
        if layer < self.dense_layers:
            return None
        masks = []
        for i in range(len(batch.seq_lens)):
            n = batch.num_blocks(i)
            keep = torch.zeros(num_kv_heads, n, dtype=torch.bool)
            keep[:, : self.sink_blocks] = True
            keep[:, max(0, n - self.recent_blocks):] = True
            masks.append(keep)
        return masks
