"""Block-sparse attention policies: the selector `build_sparse_policy` makes from the engine's sparse options.

- `QuestSelector` (decode, layers/quest.py): each KV head's top pages or blocks by an upper bound of (or, through an
  int8 copy of every key, exactly) the largest score of its query heads on them.
- `XAttentionSelector` (prefill, layers/xattention.py): per KV head and block of queries, the fewest key blocks covering
  a threshold of the mass that antidiagonal scoring estimates.
- `PrefillDecodeSelector`: XAttention for prefill rows, Quest for decode rows ("xattention+quest").
- `build_sparse_policy` maps `sparse_policy` ("full", "quest", ...) to a selector and registers the
  metadata hooks it needs on the KV cache.

Steps in which no row can drop a block (`dense_for_step`: every sequence below min_context) run as under
"full": no selection, no counts, and Quest fills no key bounds.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from nanovllm.config import QUEST_KEY_COPY_BITS
from nanovllm.layers.block_metadata import BlockKeyBounds, BlockKeyCopy
from nanovllm.layers.block_selector import BlockSelector, DenseSelector, Selection
from nanovllm.layers.quest import QUEST_PAGE_SIZE, QuestSelector
from nanovllm.layers.xattention import XAttentionSelector

if TYPE_CHECKING:
    from nanovllm.config import EngineConfig
    from nanovllm.engine.kv_cache import PagedKVCache


class PrefillDecodeSelector(BlockSelector):
    """One selector for prefill rows, another for decode rows (sparse_policy "xattention+quest")."""

    name = "xattention+quest"

    def __init__(self, prefill: BlockSelector, decode: BlockSelector):
        self.prefill, self.decode = prefill, decode
        self.narrows = decode.narrows

    def dense_for_decode(self, block_size, seq_lens) -> bool:
        return self.decode.dense_for_decode(block_size, seq_lens)

    def dense_for_step(self, block_size, query_lens, seq_lens) -> bool:
        return all(s.dense_for_step(block_size, query_lens, seq_lens) for s in (self.prefill, self.decode))

    def before_step(self, plan) -> None:
        self.prefill.before_step(plan)
        self.decode.before_step(plan)

    def decode_keep(self, layer, q, num_kv_heads, layout, key_reads=None):
        # prefill policies keep decode rows whole
        return self.decode.decode_keep(layer, q, num_kv_heads, layout, key_reads)

    def narrowed_decode(self, block_size, seq_lens) -> bool:
        return self.decode.narrowed_decode(block_size, seq_lens)

    def narrowed_blocks(self, block_size) -> int:
        return self.decode.narrowed_blocks(block_size)

    def decode_page_size(self, block_size) -> int:
        return self.decode.decode_page_size(block_size)

    def narrowing(self, block_size) -> tuple:
        return self.decode.narrowing(block_size)

    def narrow_scratch_bytes(self, max_blocks) -> int:
        return self.decode.narrow_scratch_bytes(max_blocks)

    def narrow(self, layer, q, num_kv_heads, layout, key_reads=None):
        return self.decode.narrow(layer, q, num_kv_heads, layout, key_reads)

    def host_key_codes(self, layer):
        return self.decode.host_key_codes(layer)

    def warm_up_row(self, block_size) -> int:
        return max(self.prefill.warm_up_row(block_size), self.decode.warm_up_row(block_size))

    def warm_up(self, num_kv_heads, device) -> None:
        self.prefill.warm_up(num_kv_heads, device)
        self.decode.warm_up(num_kv_heads, device)

    @contextlib.contextmanager
    def selecting_at_any_length(self) -> Iterator[None]:
        with self.prefill.selecting_at_any_length(), self.decode.selecting_at_any_length():
            yield

    def select(self, layer, q, num_kv_heads, batch) -> Selection | None:
        by_prefill = self.prefill.select(layer, q, num_kv_heads, batch)
        by_decode = self.decode.select(layer, q, num_kv_heads, batch)
        if by_prefill is None and by_decode is None:
            return None
        whole = [None] * len(batch.seq_lens)
        by_prefill, by_decode = by_prefill or whole, by_decode or whole
        return [d if n == 1 else p for p, d, n in zip(by_prefill, by_decode, batch.query_lens)]


def build_sparse_policy(config: EngineConfig, cache: PagedKVCache, host_pool=None) -> BlockSelector:
    """The selector for config.sparse_policy; registers on `cache` the hooks it needs. host_pool: the
    offload pool, whose host blocks' keys XAttention reads for its estimate."""
    if config.sparse_policy == "full":
        return DenseSelector()
    selectors = {}
    if "quest" in config.sparse_policy:
        _, num_layers, num_blocks, block_size, num_kv_heads, head_dim = cache.data.shape
        num_host_blocks, page_size = host_pool.num_host_blocks if host_pool else 0, min(QUEST_PAGE_SIZE, block_size)
        if config.quest_key_copy != "none":
            metadata = BlockKeyCopy(cache.data[0], num_host_blocks, min(config.quest_dense_layers, num_layers),
                                    page_size, QUEST_KEY_COPY_BITS[config.quest_key_copy])
        else:
            metadata = BlockKeyBounds(num_layers, num_blocks, num_host_blocks, block_size, num_kv_heads, head_dim,
                                      cache.data.device, page_size=page_size, dtype=cache.data.dtype,
                                      keys=cache.data[0])
        cache.hooks.append(metadata)
        host_keys = host_pool.host[0] if host_pool is not None else None
        rerank = 1 if config.quest_key_copy != "none" else config.quest_rerank  # every page is scored exactly
        selectors["quest"] = QuestSelector(metadata, config.quest_token_budget, config.quest_dense_layers,
                                           config.sparse_min_context, page_select=config.quest_page_select,
                                           max_model_len=config.max_model_len, rerank=rerank,
                                           device_keys=cache.data[0], host_keys=host_keys,
                                           rerank_score=config.quest_rerank_score,
                                           copied_host_keys=host_pool is not None and config.quest_host_keys == "copy")
    if "xattention" in config.sparse_policy:
        selectors["xattention"] = XAttentionSelector(cache, host_pool, config.xattn_threshold, config.xattn_stride,
                                                     config.xattn_block_size, config.sparse_min_context,
                                                     config.xattn_cover, config.xattn_dense_last_blocks,
                                                     config.xattn_local_blocks)
    if len(selectors) == 2:
        return PrefillDecodeSelector(selectors["xattention"], selectors["quest"])
    return next(iter(selectors.values()))
