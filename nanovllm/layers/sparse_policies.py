"""Block-sparse attention policies: block selectors built from the engine's sparse options.

- `QuestSelector` (decode): per 16-token page, the elementwise min and max of its keys (kept through
  the KV-write hook, `BlockKeyBounds`) bound every query's score on the page from above:
  sum_d max(q_d * max_d, q_d * min_d). A block's bound is its pages' maximum, a KV head's the maximum
  over its query heads; each KV head reads its top blocks within `token_budget` tokens plus the sink
  block and the most recent block. The first `dense_layers` layers, prefill rows and sequences shorter
  than `min_context` stay dense.
- `build_sparse_policy` maps `sparse_policy` ("full", "quest", ...) to a selector and registers the
  metadata hooks it needs on the KV cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanovllm.layers.block_metadata import BlockKeyBounds
from nanovllm.layers.block_selector import BlockSelector, DenseSelector, Selection, SelectionInput

if TYPE_CHECKING:
    from nanovllm.config import EngineConfig
    from nanovllm.engine.kv_cache import PagedKVCache

QUEST_PAGE_SIZE = 16


class QuestSelector(BlockSelector):
    name = "quest"

    def __init__(self, bounds: BlockKeyBounds, token_budget: int, dense_layers: int, min_context: int,
                 sink_blocks: int = 1, recent_blocks: int = 1):
        self.bounds = bounds
        self.token_budget, self.dense_layers, self.min_context = token_budget, dense_layers, min_context
        self.sink_blocks, self.recent_blocks = sink_blocks, recent_blocks

    def select(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput) -> Selection | None:
        if layer < self.dense_layers:
            return None
        budget = max(1, self.token_budget // batch.block_size)
        masks, sparse = [], False
        for i in range(len(batch.seq_lens)):
            n = batch.num_blocks(i)
            keep = torch.ones(num_kv_heads, n, dtype=torch.bool)
            fixed = self.sink_blocks + self.recent_blocks
            if batch.query_lens[i] == 1 and batch.seq_lens[i] >= self.min_context and n > budget + fixed:
                scores = self.block_scores(layer, q[batch.query_rows(i)][0], num_kv_heads, batch, i)
                middle = scores[:, self.sink_blocks : n - self.recent_blocks]
                keep[:, self.sink_blocks : n - self.recent_blocks] = False
                keep.scatter_(1, middle.topk(budget, dim=1).indices.cpu() + self.sink_blocks, True)
                sparse = True
            masks.append(keep)
        return masks if sparse else None

    def block_scores(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput,
                     i: int) -> torch.Tensor:
        """[Hk, num_blocks] upper bounds of sequence i's query q [Hq, D] on each of its blocks."""
        n = batch.num_blocks(i)
        lo, hi = self.bounds.block_pages(layer, batch.block_tables[i][:n], batch.on_host[i][:n] if batch.on_host else None)
        group = q.shape[0] // num_kv_heads
        q = q.float().view(num_kv_heads, group, 1, -1)  # [Hk, group, 1, D]
        lo, hi = lo.float().transpose(0, 1)[:, None], hi.float().transpose(0, 1)[:, None]  # [Hk, 1, pages, D]
        page_scores = torch.maximum(q * hi, q * lo).sum(-1).amax(1)  # [Hk, pages]
        written = -(-batch.seq_lens[i] // self.bounds.page_size)
        page_scores[:, written:] = float("-inf")  # pages past the sequence's end hold no keys
        return page_scores.view(num_kv_heads, n, -1).amax(-1)


def build_sparse_policy(config: EngineConfig, cache: PagedKVCache, num_host_blocks: int) -> BlockSelector:
    """The selector for config.sparse_policy; registers on `cache` the hooks it needs."""
    if config.sparse_policy == "full":
        return DenseSelector()
    if config.sparse_policy != "quest":
        raise ValueError(f"sparse_policy={config.sparse_policy!r} is not available yet (available: full, quest)")
    _, num_layers, num_blocks, block_size, num_kv_heads, head_dim = cache.data.shape
    bounds = BlockKeyBounds(num_layers, num_blocks, num_host_blocks, block_size, num_kv_heads, head_dim,
                            cache.data.device, page_size=min(QUEST_PAGE_SIZE, block_size), dtype=cache.data.dtype)
    cache.hooks.append(bounds)
    return QuestSelector(bounds, config.quest_token_budget, config.quest_dense_layers, config.sparse_min_context)
