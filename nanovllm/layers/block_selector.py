"""Block selection: which KV blocks each KV head attends to, per layer and step.

Every KV-access strategy (layers/kv_access.py, engine/offload/) asks the step's selector before it
copies or attends. A selector sees the layer, the step's queries and each sequence's block count and
returns, per sequence, a bool mask [num_kv_heads, num_blocks] over the sequence's blocks in position
order, or None for "every block" (the dense fast path). Blocks that hold any of the step's query
tokens are always attended to, whatever the mask says, so a selector only narrows the history that
precedes the queries, and the causal mask stays right when the rest is dropped.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionInput:
    """What a selector may look at besides the queries: per sequence, its new tokens (query rows
    cu_query_lens[i]:cu_query_lens[i+1] of q), its KV length after the step and its block count."""

    query_lens: list[int]
    seq_lens: list[int]
    block_size: int

    def num_blocks(self, i: int) -> int:
        return -(-self.seq_lens[i] // self.block_size)

    def first_query_block(self, i: int) -> int:
        """The first block holding one of sequence i's new tokens (blocks before it precede every query)."""
        return (self.seq_lens[i] - self.query_lens[i]) // self.block_size


Selection = list[torch.Tensor]  # per sequence: bool [num_kv_heads, num_blocks], True = attend


class BlockSelector(ABC):
    name: str
    dense = False  # True: select() always returns None; strategies may then use fixed, pre-planned copies

    @abstractmethod
    def select(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput) -> Selection | None:
        """q: [T, Hq, D] this layer's queries (post-RoPE). None: every block of every sequence."""


def with_query_blocks(selection: Selection, batch: SelectionInput) -> Selection:
    """The selection with every block that holds a query token switched on (see the module docstring)."""
    masks = []
    for i, mask in enumerate(selection):
        if mask.shape[1] != batch.num_blocks(i):
            raise ValueError(f"selection for sequence {i} covers {mask.shape[1]} blocks, it has {batch.num_blocks(i)}")
        mask = mask.clone()
        mask[:, batch.first_query_block(i):] = True
        masks.append(mask)
    return masks


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
