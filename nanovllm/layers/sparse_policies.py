"""Block-sparse attention policies: block selectors built from the engine's sparse options.

- `QuestSelector` (decode): per 16-token page, the elementwise min and max of its keys (kept through
  lazily from the cache, `BlockKeyBounds`) bound every query's score on the page from above:
  sum_d max(q_d * max_d, q_d * min_d). A block's bound is its pages' maximum, a KV head's the maximum
  over its query heads; each KV head reads its top blocks within `token_budget` tokens plus the sink
  block and the most recent block, or with `page_select` (the engine's default, `quest_page_select`) its
  top pages. With `rerank` > 1 the bound's top rerank x budget columns are candidates, ranked again by
  their keys' exact largest score (the maximum over the group's query heads and the column's keys, which the
  bound bounds from above), or with `rerank_score` "mass" by each query head's softmax mass on the column among
  the candidates, sink and recent columns (the group's maximum), and the budget's best of them kept. Given an
  int8 copy of every key instead of the bounds (`BlockKeyCopy`, quest_key_copy="int8", the engine's default), every
  column is ranked by its largest q . k through the copy (`copy_scores`): no bound, no rerank. The first
  `dense_layers` layers, prefill rows and sequences shorter than `min_context` stay dense.
- `XAttentionSelector` (prefill): antidiagonal scoring. Queries and keys are cut into tiles of
  `stride` positions; a (query tile, key tile) pair scores the sum of q.k over the tile's antidiagonal
  (one stride-th of the full Q.K^T work), softmax per query head over the visible key tiles, the
  probabilities summed over the query heads of each KV-head group (K is never repeated per query head)
  and over `block_size`-token blocks. Per KV head and block of queries, the fewest key blocks that
  cover `threshold` of that estimated mass are kept, with the sink block and the diagonal, and the blocks
  the options force (`with_forced_blocks`: all of them for the prompt's last `dense_last_blocks` query
  blocks, a window of `local_blocks` before each one). Host blocks' K (never V) is read for the estimate.
  Selections are made at max(block_size, KV block) tokens.
- `build_sparse_policy` maps `sparse_policy` ("full", "quest", ...) to a selector and registers the
  metadata hooks it needs on the KV cache.

Steps in which no row can drop a block (`dense_for_step`: every sequence below min_context) run as under
"full": no selection, no counts, and Quest fills no key bounds.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanovllm.config import QUEST_KEY_COPY_BITS, QUEST_RERANK_SCORES
from nanovllm.layers.block_metadata import BlockKeyBounds, BlockKeyCopy
from nanovllm.layers.block_selector import BlockSelector, DecodeLayout, DenseSelector, Selection, SelectionInput

if TYPE_CHECKING:
    from nanovllm.config import EngineConfig
    from nanovllm.engine.kv_cache import PagedKVCache
    from nanovllm.engine.step_plan import StepPlan
    from nanovllm.kernels.reference import KeyCodes

QUEST_PAGE_SIZE = 16
ESTIMATE_CHUNK = 8192  # XAttention's estimate takes queries in chunks of about this many tokens


class QuestSelector(BlockSelector):
    name = "quest"
    narrows = True

    def __init__(self, metadata: BlockKeyBounds | BlockKeyCopy, token_budget: int, dense_layers: int,
                 min_context: int, sink_blocks: int = 1, recent_blocks: int = 1, page_select: bool = False,
                 max_model_len: int | None = None, rerank: int = 1, device_keys: torch.Tensor | None = None,
                 host_keys: torch.Tensor | None = None, rerank_score: str = "max", copied_host_keys: bool = False):
        """metadata: what pages are scored by: Quest's bounds (BlockKeyBounds: the upper bound, then the rerank)
        or an int8 copy of every key (BlockKeyCopy: each page's largest q . k through the copy, on every page;
        no rerank). page_select: decode steps (decode_keep, narrow) keep each KV head's top pages of the bounds
        (token_budget // page_size of them) rather than its top blocks, plus the sink and recent blocks'
        pages; select() keeps selecting blocks (the strategies send a mixed step's decode rows to
        decode_keep too, `MixedRows`). max_model_len: the longest sequence; with it every narrow() on CUDA
        runs one compiled variant of the top kernel, which warm_up() compiles. rerank: candidates per kept
        column, ranked by their keys: device_keys [layers, blocks, block_size, Hk, D] (the device pool's; needed
        when rerank > 1) and host_keys [layers, host blocks, block_size, Hk, D] for host blocks. rerank_score:
        "max" (a candidate's largest q . k) or "mass" (its softmax mass, `_mass_scores`). copied_host_keys:
        narrowed decode steps read kept host pages' keys from the int8 copy (`host_key_codes`)."""
        self.metadata, self.exact = metadata, isinstance(metadata, BlockKeyCopy)
        self.token_budget, self.dense_layers, self.min_context = token_budget, dense_layers, min_context
        self.sink_blocks, self.recent_blocks, self.page_select = sink_blocks, recent_blocks, page_select
        self.max_model_len, self.rerank, self.rerank_score = max_model_len, rerank, rerank_score
        self.device_keys, self.host_keys = device_keys, host_keys
        # narrow() on CUDA through one Triton kernel (kernels/triton_quest.ordered_top_columns) instead of
        # top-k + sort (1.13x the narrowed 128K offload step at budget 2048, docs/BENCHMARKS.md)
        self.ordered_top = True
        if metadata.keys is not None and recent_blocks < 1:
            raise ValueError("lazily filled key metadata needs recent_blocks >= 1 (the block being written is kept)")
        self.copied_host_keys = copied_host_keys
        if copied_host_keys and not (self.exact and metadata.bits == 8):
            raise ValueError("copied_host_keys reads host pages' keys from an int8 key copy: the metadata has none")
        if rerank > 1 and self.exact:
            raise ValueError(f"rerank={rerank}: the key copy scores every page exactly, there is nothing to rerank")
        if rerank > 1 and device_keys is None:
            raise ValueError(f"rerank={rerank} ranks candidates by their keys: device_keys is needed")
        if rerank_score not in QUEST_RERANK_SCORES:
            raise ValueError(f"rerank_score must be one of {QUEST_RERANK_SCORES}, got {rerank_score!r}")

    def select(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput) -> Selection | None:
        if layer < self.dense_layers:
            return None
        budget = max(1, self.token_budget // batch.block_size)
        masks, sparse = [], False
        for i in range(len(batch.seq_lens)):
            n = batch.num_blocks(i)
            fixed = self.sink_blocks + self.recent_blocks
            if batch.query_lens[i] > 1 or batch.seq_lens[i] < self.min_context or n <= budget + fixed:
                masks.append(None)
                continue
            scores = self.block_scores(layer, q[batch.query_rows(i)][0], num_kv_heads, batch, i)
            middle = scores[:, self.sink_blocks : n - self.recent_blocks]
            keep = torch.ones(num_kv_heads, n, dtype=torch.bool, device=q.device)
            keep[:, self.sink_blocks : n - self.recent_blocks] = False
            keep.scatter_(1, middle.topk(budget, dim=1).indices + self.sink_blocks, True)
            masks.append(keep)
            sparse = True
        return masks if sparse else None

    def selecting_at_any_length(self) -> contextlib.AbstractContextManager[None]:
        return _min_context_zero(self)

    def warm_up_row(self, block_size: int) -> int:
        """A row whose middle (between the sink and recent blocks) holds more than the budget: it is narrowed,
        scored and reranked."""
        return (self.sink_blocks + self.recent_blocks + 1) * block_size + self.token_budget

    def sparse_rows(self, block_size: int, seq_lens: list[int]) -> list[bool]:
        """Which decode rows drop blocks (pages): long enough, and with more of them between the sink and
        the recent blocks than the budget keeps."""
        per_block, budget = block_size // self.decode_page_size(block_size), self._budget(block_size)
        fixed = self.sink_blocks + self.recent_blocks
        return [n >= self.min_context and (-(-n // block_size) - fixed) * per_block > budget for n in seq_lens]

    def decode_page_size(self, block_size: int) -> int:
        return self.metadata.page_size if self.page_select else block_size

    def _budget(self, block_size: int) -> int:
        """Columns (blocks, or pages) each KV head keeps between the sink and the recent blocks."""
        return max(1, self.token_budget // self.decode_page_size(block_size))

    def dense_for_decode(self, block_size: int, seq_lens: list[int]) -> bool:
        return not any(self.sparse_rows(block_size, seq_lens))

    def dense_for_step(self, block_size: int, query_lens: list[int], seq_lens: list[int]) -> bool:
        sparse = self.sparse_rows(block_size, seq_lens)
        return not any(s and q == 1 for s, q in zip(sparse, query_lens))

    def before_step(self, plan: StepPlan) -> None:
        """Lazily filled metadata (bounds or key copy): the step's written blocks are stale, and the full blocks
        of its sparse decode rows get exact rows (each block's once; the most recent block, the only one not
        full, is always kept, so its rows are never read)."""
        if self.metadata.keys is None:
            return
        # a prefill row of a sequence may be its recompute after a preemption: its blocks are checked afresh
        self.metadata.forget(plan.released + [i for i, q in zip(plan.seq_ids, plan.query_lens) if q > 1])
        bs = self.metadata.block_size
        written = [b for table, q, n in zip(plan.block_tables, plan.query_lens, plan.seq_lens)
                   for b in table[(n - q) // bs : -(-n // bs)]]
        self.metadata.written(written)
        sparse = self.sparse_rows(bs, plan.seq_lens)
        for i, (seq_id, q, n) in enumerate(zip(plan.seq_ids, plan.query_lens, plan.seq_lens)):
            if sparse[i] and q == 1:
                full = (n - 1) // bs
                self.metadata.fill(seq_id, plan.block_tables[i][:full], plan.on_host[i] if plan.on_host else None)

    def decode_keep(self, layer: int, q: torch.Tensor, num_kv_heads: int, layout: DecodeLayout,
                    key_reads: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
        """select() for a decode step, on the device: one batched bound, top-k and mask, no host sync."""
        if layer < self.dense_layers:
            return None
        batch = layout.batch
        sparse = self.sparse_rows(batch.block_size, batch.seq_lens)
        if not any(sparse):
            return None
        rows_sparse = torch.tensor(sparse, device=q.device)[:, None, None]
        keep = self._top_columns(layer, q, num_kv_heads, layout, key_reads, rows_sparse)
        columns = layout.at(self.decode_page_size(batch.block_size))
        keep = torch.where(rows_sparse, keep, columns.valid[:, None, :])
        per_block = batch.block_size // columns.block_size
        widest = max(self.narrowed_blocks(batch.block_size) if s else batch.num_blocks(i) * per_block
                     for i, s in enumerate(sparse))
        return keep, widest

    def narrowed_decode(self, block_size: int, seq_lens: list[int]) -> bool:
        return all(self.sparse_rows(block_size, seq_lens))

    def narrowed_blocks(self, block_size: int) -> int:
        per_block = block_size // self.decode_page_size(block_size)
        return self._budget(block_size) + (self.sink_blocks + self.recent_blocks) * per_block

    def narrowing(self, block_size: int) -> tuple:
        return super().narrowing(block_size) + (self.rerank, self.rerank_score, self.copied_host_keys)

    def host_key_codes(self, layer: int) -> KeyCodes | None:
        if not self.copied_host_keys or layer < self.dense_layers:
            return None
        return self.metadata.host_key_codes(layer)

    def narrow_scratch_bytes(self, max_blocks: int) -> int:
        block_size = self.metadata.block_size
        if self.exact:  # on CUDA the kernel reads the copy in place; the reference dequantizes it and multiplies
            num_kv_heads, head_dim = self.metadata.keys.shape[-2:]  # the codes' width is head_dim * bits / 8
            return max_blocks * block_size * num_kv_heads * (4 if self.metadata.codes.is_cuda else head_dim * 4 + 64)
        _, _, num_kv_heads, head_dim = self.metadata.min.shape
        # rerank: the candidates' keys gathered (twice with host blocks) and in float32, their scores; "mass" also
        # the sink and recent columns' keys and per query head a log-sum-exp and a mass (group <= head_dim)
        columns, mass = self.rerank * self._budget(block_size), self.rerank_score == "mass"
        if mass:
            columns += (self.sink_blocks + self.recent_blocks) * (block_size // self.decode_page_size(block_size))
        per_column = (self.decode_page_size(block_size) * 12 + (16 if mass else 0)) * num_kv_heads * head_dim
        reranked = 0 if self.rerank == 1 else columns * per_column
        if self.metadata.min.is_cuda:  # the kernel reads the bounds in place: scores, masks and tables per column
            return max_blocks * block_size // self.decode_page_size(block_size) * num_kv_heads * 64 + reranked
        return max_blocks * self.metadata.pages_per_block * num_kv_heads * head_dim * 16 + reranked  # min, max, float32

    def narrow(self, layer: int, q: torch.Tensor, num_kv_heads: int, layout: DecodeLayout,
               key_reads: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The kept columns as positions [B, Hk, sink + budget + recent]: the sink block's, the top-k of the
        middle's (by bound, then sorted) and the most recent block's, -1 for none. Ascending in every row
        whose middle holds more columns than the budget (each row of a narrowed step); in other rows (a
        graph's padding, a capture) the -1 may come between. No mask over every column, no scan: a
        narrowed step's tables come from these positions by one gather (kv_access.column_tables). rows
        [B, 1, 1] bool: the rows whose choice counts (decode_keep's sparse rows); the others read no keys."""
        if layer < self.dense_layers:
            return None
        page_size = self.decode_page_size(layout.block_size)
        per_block = layout.block_size // page_size
        scores = self.batch_block_scores(layer, q, num_kv_heads, layout, pages=per_block > 1)  # [B, Hk, C]
        sink, recent = self.sink_blocks * per_block, self.recent_blocks * per_block
        ends = layout.at(page_size).num_blocks  # [B] each row's columns (counted once per step, not per layer)
        budget = min(self._budget(layout.block_size), max(0, scores.shape[-1] - sink - recent))
        wide = min(self.rerank * budget, max(0, scores.shape[-1] - sink - recent))
        kept = self._top(scores, ends, sink, wide, recent, self._max_columns(layout.block_size))
        if wide == budget:
            return kept
        candidates = kept[..., sink : sink + wide]  # ascending, -1 for none
        if rows is not None:
            candidates = candidates.masked_fill(~rows, -1)
        if self.rerank_score == "mass":  # the kept sink and recent columns are the softmax's other terms
            fixed = torch.cat([kept[..., :sink], kept[..., sink + wide :]], -1)
            fixed = fixed if rows is None else fixed.masked_fill(~rows, -1)
            exact = self._mass_scores(layer, q, layout, candidates, fixed, page_size, key_reads)
        else:
            exact = self.candidate_scores(layer, q, layout, candidates, page_size, key_reads)
        most = self.rerank * self._budget(layout.block_size)
        chosen = self._top(exact, torch.full_like(ends, wide), 0, budget, 0, most)
        best = candidates.gather(-1, chosen.clamp(min=0)).masked_fill(chosen < 0, -1)
        return torch.cat([kept[..., :sink], best, kept[..., sink + wide :]], -1)

    def _top(self, scores: torch.Tensor, ends: torch.Tensor, sink: int, budget: int, recent: int,
             max_columns: int | None) -> torch.Tensor:
        """max_columns: the widest row of this call site (fixes the kernel variants; warm_up compiles them)."""
        if self.ordered_top and scores.is_cuda:
            from nanovllm.kernels.triton_quest import ordered_top_columns

            return ordered_top_columns(scores, ends, sink, budget, recent, max_columns=max_columns)
        return quest_top_reference(scores, ends, sink, budget, recent)

    def _mass_scores(self, layer: int, q: torch.Tensor, layout: DecodeLayout, candidates: torch.Tensor,
                     fixed: torch.Tensor, column_size: int, key_reads: torch.Tensor | None) -> torch.Tensor:
        """[B, Hk, N] rerank_score "mass" of candidates [B, Hk, N] (-1: none, -inf out): each query head's softmax
        (scaled by 1/sqrt(D)) over the keys of the candidates and of the kept sink and recent columns fixed
        [B, Hk, F], summed over a candidate's keys, the maximum over the KV head's query heads (the fixed
        columns' keys are read besides the candidates', and counted)."""
        columns = torch.cat([candidates, fixed], -1)
        lse = self.candidate_scores(layer, q, layout, columns, column_size, key_reads, head_lse=True)
        mass = (lse - lse.logsumexp(-1, keepdim=True)).exp().nan_to_num(0.0)  # a row without keys: nan
        return mass.amax(2)[..., : candidates.shape[-1]].masked_fill(candidates < 0, float("-inf"))

    def candidate_scores(self, layer: int, q: torch.Tensor, layout: DecodeLayout, columns: torch.Tensor,
                         column_size: int, key_reads: torch.Tensor | None = None,
                         head_lse: bool = False) -> torch.Tensor:
        """[B, Hk, N] float32: for each column position of columns [B, Hk, N] (-1: none, -inf out) in units
        of column_size tokens, the largest q . k over its keys (those before the sequence's end) and the KV
        head's query heads q [B, Hq, D]: the exact score the Quest bound bounds from above. Keys come from
        the device pool or, for host blocks, host_keys. On CUDA one Triton kernel (host keys read in place,
        kernels/triton_quest.candidate_max_scores); this is its reference. key_reads [B]: each row's columns
        whose keys were read from host_keys are added to it. head_lse: [B, Hk, group, N] instead, each query
        head's log-sum-exp of q . k / sqrt(D) over the column's keys (-inf for none)."""
        if q.is_cuda:
            from nanovllm.kernels.triton_quest import candidate_max_scores

            host = self.host_keys[layer] if self.host_keys is not None else None
            return candidate_max_scores(q, self.device_keys[layer], host, layout.ids, layout.seq_lens,
                                        columns, layout.block_size, column_size, layout.base, key_reads=key_reads,
                                        head_lse=head_lse)
        batch, num_kv_heads, _ = columns.shape
        per_block, block_size = layout.block_size // column_size, layout.block_size
        col = columns.clamp(min=0)
        block_col = col // per_block
        flat = block_col.flatten(1)
        blocks, on_host = layout.blocks.gather(1, flat).view_as(col), layout.on_host.gather(1, flat).view_as(col)
        token = ((col % per_block) * column_size)[..., None] + torch.arange(column_size, device=col.device)
        head = torch.arange(num_kv_heads, device=col.device)[None, :, None, None]
        device_ids = torch.where(on_host | (blocks < 0), 0, blocks)  # ids within each pool
        keys = self.device_keys[layer][device_ids[..., None], token, head]  # [B, Hk, N, P, D]
        if self.host_keys is not None:  # no host sync: every row gathers from both pools
            host = self.host_keys[layer][torch.where(on_host, blocks, 0)[..., None], token, head]
            keys = torch.where(on_host[..., None, None], host, keys)
            if key_reads is not None:
                key_reads += (on_host & (columns >= 0)).sum((1, 2))
        group = q.view(batch, num_kv_heads, -1, q.shape[-1]).float()
        scores = torch.einsum("bhgd,bhnpd->bhnpg", group, keys.float())  # [B, Hk, N, P, group]
        position = (block_col * block_size)[..., None] + token
        present = (columns >= 0)[..., None] & (position < layout.seq_lens[:, None, None, None])
        scores = scores.masked_fill(~present[..., None], float("-inf"))
        if head_lse:
            return (scores * q.shape[-1] ** -0.5).logsumexp(3).transpose(2, 3)  # [B, Hk, group, N]
        return scores.amax((3, 4))

    def _max_columns(self, block_size: int) -> int | None:
        """Columns of decode_page_size tokens in the longest sequence's blocks (None: no longest known)."""
        if self.max_model_len is None:
            return None
        return -(-self.max_model_len // block_size) * (block_size // self.decode_page_size(block_size))

    def warm_up(self, num_kv_heads: int, device: torch.device) -> None:
        """Compiles the ordered top kernel's variants of this engine (rows within the register chunk and, for
        sequences longer than it, rows read in chunks; long rows' two stages) so that no request waits for them."""
        block_size = self.metadata.block_size
        columns = self._max_columns(block_size)
        if not (self.ordered_top and device.type == "cuda" and columns):
            return
        from nanovllm.kernels.triton_quest import MAX_ROW_IN_REGISTERS, ordered_top_columns, top_segment

        per_block = block_size // self.decode_page_size(block_size)
        sink, recent = self.sink_blocks * per_block, self.recent_blocks * per_block
        for width in sorted({min(columns, MAX_ROW_IN_REGISTERS), columns}):
            scores = torch.zeros(1, num_kv_heads, width, dtype=torch.float32, device=device)
            ends = torch.full((1,), width, dtype=torch.int64, device=device)
            budget = max(0, min(self._budget(block_size), width - sink - recent))
            wide = min(self.rerank * budget, width - sink - recent)
            for stages in (1, 2) if top_segment(width, wide) else (1,):  # both: which one runs depends on the batch
                ordered_top_columns(scores, ends, sink, wide, recent, max_columns=columns, stages=stages)
            if wide > budget:  # the candidates' second ranking: no sink, no recent columns
                ordered_top_columns(scores[..., :wide].contiguous(), torch.full_like(ends, wide), 0, budget, 0,
                                    max_columns=self.rerank * self._budget(block_size))

    def _top_columns(self, layer: int, q: torch.Tensor, num_kv_heads: int, layout: DecodeLayout,
                     key_reads: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """keep [B, Hk, columns] over layout.at(decode_page_size): narrow()'s columns as a mask (the
        per-step device selection of decode_keep, whose rows need not all be narrowed)."""
        kept = self.narrow(layer, q, num_kv_heads, layout, key_reads, rows)
        num_columns = layout.at(self.decode_page_size(layout.block_size)).ids.shape[1]
        keep = torch.zeros(*kept.shape[:2], num_columns + 1, dtype=torch.bool, device=kept.device)
        return keep.scatter_(-1, kept.masked_fill(kept < 0, num_columns), True)[..., :num_columns]

    def batch_block_scores(self, layer: int, q: torch.Tensor, num_kv_heads: int, layout: DecodeLayout,
                           pages: bool = False) -> torch.Tensor:
        """[B, Hk, blocks] upper bounds of each sequence's query q [B, Hq, D] on its blocks (-inf past its
        keys); pages: on each page, [B, Hk, blocks * pages_per_block]. Per dimension max(q*max, q*min) is
        q+ * max + q- * min (max >= min), so the bound of a page is two matrix products. On CUDA one
        Triton kernel reads the bounds through the tables (kernels/triton_quest.py); this is its reference."""
        if self.exact:
            return self.copy_scores(layer, q, num_kv_heads, layout, pages)
        if q.is_cuda:
            from nanovllm.kernels.triton_quest import quest_block_scores

            b = self.metadata
            return quest_block_scores(q, b.min[layer], b.max[layer], b.host_min[layer], b.host_max[layer], layout.ids,
                                      layout.seq_lens, b.block_size, b.page_size, layout.base, pages=pages)
        lo, hi = self.metadata.layout_pages(layer, layout)  # [B, pages, Hk, D]
        batch_size, num_pages = lo.shape[:2]
        q = q.float().view(batch_size, num_kv_heads, -1, q.shape[-1])  # [B, Hk, group, D]
        lo, hi = lo.float().permute(0, 2, 3, 1), hi.float().permute(0, 2, 3, 1)  # [B, Hk, D, pages]
        page_scores = (q.clamp(min=0) @ hi + q.clamp(max=0) @ lo).amax(2)  # [B, Hk, pages]
        written = -(-layout.seq_lens // self.metadata.page_size)  # pages holding keys
        holding = torch.arange(num_pages, device=q.device)[None, :] < written[:, None]
        page_scores = page_scores.masked_fill(~holding[:, None, :], float("-inf"))
        if pages:
            return page_scores
        return page_scores.view(batch_size, num_kv_heads, -1, self.metadata.pages_per_block).amax(-1)

    def copy_scores(self, layer: int, q: torch.Tensor, num_kv_heads: int, layout: DecodeLayout,
                    pages: bool = False) -> torch.Tensor:
        """batch_block_scores through the key copy: each block's (pages: page's) largest q . k over its keys
        before the sequence's end and the KV head's query heads, the keys as the copy holds them; -inf past
        them. On CUDA one Triton kernel (kernels/triton_quest.key_copy_scores); this is its reference."""
        copy = self.metadata
        if q.is_cuda:
            from nanovllm.kernels.triton_quest import key_copy_scores

            return key_copy_scores(q, *copy.layer_arrays(layer), layout.ids, layout.seq_lens, copy.block_size,
                                   copy.page_size, layout.base, pages=pages, bits=copy.bits)
        keys = copy.layout_keys(layer, layout)  # [B, tokens, Hk, D]
        group = q.float().view(q.shape[0], num_kv_heads, -1, q.shape[-1])
        scores = torch.einsum("bhgd,bthd->bhgt", group, keys).amax(2)  # [B, Hk, tokens]
        past = torch.arange(scores.shape[-1], device=q.device)[None, :] >= layout.seq_lens[:, None]
        scores = scores.masked_fill(past[:, None, :], float("-inf"))
        size = copy.page_size if pages else copy.block_size
        return scores.view(*scores.shape[:2], -1, size).amax(-1)

    def block_scores(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput,
                     i: int) -> torch.Tensor:
        """[Hk, num_blocks] upper bounds of sequence i's query q [Hq, D] on each of its blocks (through the key
        copy: each block's largest q . k)."""
        n = batch.num_blocks(i)
        on_host = batch.on_host[i][:n] if batch.on_host else None
        if self.exact:
            keys = self.metadata.block_keys(layer, batch.block_tables[i][:n], on_host)
            group = q.float().view(num_kv_heads, -1, q.shape[-1])
            scores = torch.einsum("hgd,thd->hgt", group, keys).amax(1)  # [Hk, tokens]
            scores[:, batch.seq_lens[i]:] = float("-inf")
            return scores.view(num_kv_heads, n, -1).amax(-1)
        lo, hi = self.metadata.block_pages(layer, batch.block_tables[i][:n], on_host)
        group = q.shape[0] // num_kv_heads
        q = q.float().view(num_kv_heads, group, 1, -1)  # [Hk, group, 1, D]
        lo, hi = lo.float().transpose(0, 1)[:, None], hi.float().transpose(0, 1)[:, None]  # [Hk, 1, pages, D]
        page_scores = torch.maximum(q * hi, q * lo).sum(-1).amax(1)  # [Hk, pages]
        written = -(-batch.seq_lens[i] // self.metadata.page_size)
        page_scores[:, written:] = float("-inf")  # pages past the sequence's end hold no keys
        return page_scores.view(num_kv_heads, n, -1).amax(-1)


class XAttentionSelector(BlockSelector):
    name = "xattention"

    def __init__(self, cache: PagedKVCache, host_pool, threshold: float, stride: int, block_size: int,
                 min_context: int, cover: str = "head", dense_last_blocks: int = 0, local_blocks: int = 0):
        """host_pool: the offload pool (read_keys), or None. cover "group": the summed mass of a KV head's
        query heads covers the threshold; "head": each query head's own mass does, and the KV head keeps the
        union of its query heads' blocks (a head attending elsewhere than its group keeps its blocks).
        dense_last_blocks, local_blocks: blocks always kept (`with_forced_blocks`)."""
        self.cache, self.host_pool = cache, host_pool
        self.threshold, self.stride, self.block_size, self.min_context = threshold, stride, block_size, min_context
        self.cover, self.dense_last_blocks, self.local_blocks = cover, dense_last_blocks, local_blocks
        # the Triton estimate (kernels/triton_xattention.py) instead of the PyTorch path: off, as on the H200 it
        # took 1.5-1.9x the PyTorch path's time (68.7 vs 35.6 ms at 128K, docs/BENCHMARKS.md)
        self.fused_estimate = False
        # the softmax and the granule sums of the PyTorch path's scores in one Triton kernel
        # (triton_xattention.softmax_granule_sums) on CUDA: 13.1 vs 17.4 ms per 128K estimate on the H200
        self.fused_granule_sums = True
        # the estimate's key and query tiles made by one gather / one scaling kernel each instead of a flip and
        # layout copies (key_tile_rows, query_tile_rows), the same tensors: 12.3 vs 13.4 ms per 128K estimate
        # on the H200 (docs/BENCHMARKS.md)
        self.one_copy_tiles = True

    def warm_up(self, num_kv_heads: int, device: torch.device) -> None:
        """Compiles the granule-sums kernel's variant of this engine (the scores' dtype, the tiles per granule):
        the engine's warm-up steps are below min_context or too short to select."""
        granule = max(self.cache.data.shape[3], self.block_size)
        q = torch.empty(0, dtype=self.cache.data.dtype, device=device)
        sums = self._granule_sums_kernel(q, granule)
        if sums is not None:
            tiles = granule // self.stride
            sums(torch.zeros(1, tiles, tiles, dtype=_work_dtype(q), device=device), 0, 1, 1, tiles)

    def selecting_at_any_length(self) -> contextlib.AbstractContextManager[None]:
        return _min_context_zero(self)

    def dense_for_decode(self, block_size: int, seq_lens: list[int]) -> bool:
        return True  # a prefill policy: decode rows attend to every block

    def dense_for_step(self, block_size: int, query_lens: list[int], seq_lens: list[int]) -> bool:
        return all(q == 1 or n < self.min_context for q, n in zip(query_lens, seq_lens))

    def select(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput) -> Selection | None:
        masks, sparse = [], False
        for i in range(len(batch.seq_lens)):
            if batch.query_lens[i] == 1 or batch.seq_lens[i] < self.min_context:
                masks.append(None)
                continue
            keep = self.sequence_selection(q[batch.query_rows(i)], self._keys(layer, batch, i), batch.block_size)
            masks.append(self.with_forced_blocks(keep, batch, i))
            sparse = True
        return masks if sparse else None

    def with_forced_blocks(self, keep: torch.Tensor, batch: SelectionInput, i: int) -> torch.Tensor:
        """Sequence i's keep [Hk, query blocks, blocks] with the blocks the options always keep switched on
        (visible ones only), in units of `block_size` tokens rounded out to whole KV blocks: every block for
        the KV blocks holding the prefill's last `dense_last_blocks` blocks of queries (counted from the end
        of the prompt, not of this chunk), and per KV block of queries the `local_blocks` blocks of keys
        before its first token's block (a local window)."""
        kv_block, xb, local = batch.block_size, self.block_size, self.local_blocks
        first, n = batch.first_query_block(i), keep.shape[-1]
        dense_from = self._dense_from(batch.prefill_end(i), kv_block, n)
        if dense_from >= n and not local:
            return keep
        rows = torch.arange(first, n, device=keep.device)[:, None]
        columns = torch.arange(n, device=keep.device)
        forced = rows >= dense_from
        if local:
            window = (rows * kv_block // xb - local) * xb // kv_block  # each row's first block kept (may be < 0)
            forced = forced | (columns >= window)
        return keep | (forced & (columns <= rows))

    def _dense_from(self, prefill_end: int, kv_block: int, num_blocks: int) -> int:
        """The first KV block holding one of the prefill's last dense_last_blocks blocks of queries (of
        block_size tokens, the last one partial); num_blocks when there are none."""
        if not self.dense_last_blocks:
            return num_blocks
        return max(0, -(-prefill_end // self.block_size) - self.dense_last_blocks) * self.block_size // kv_block

    def _keys(self, layer: int, batch: SelectionInput, i: int) -> torch.Tensor:
        """[seq_len, Hk, D] keys of sequence i: device blocks from the cache, host blocks' K from the pool."""
        n, table = batch.num_blocks(i), batch.block_tables[i]
        flags = batch.on_host[i][:n] if batch.on_host else [False] * n
        k_cache = self.cache.layer(layer)[0]
        blocks = k_cache.index_select(0, self._device_ids(batch, i, flags, k_cache.device))
        host = [c for c in range(n) if flags[c]]
        if host:
            host_ids = [table[c] for c in host]
            keys = self.host_pool.read_keys(layer, host_ids, k_cache.device)
            blocks.index_copy_(0, self._host_columns(batch, i, host, k_cache.device), keys)
            if batch.host_keys is not None:
                batch.host_keys.add(host_ids, keys)
            if batch.stats is not None:
                batch.stats.host_bytes[i] += len(host) * self.host_pool.block_bytes_per_layer // 2
        return blocks.flatten(0, 1)[: batch.seq_lens[i]]

    @staticmethod
    def _device_ids(batch: SelectionInput, i: int, on_host: list[bool], device: torch.device) -> torch.Tensor:
        """Sequence i's blocks in the device pool (0 for its host blocks), on the device: a view of the step's
        device tables where the strategy has them (no copy per layer)."""
        n = len(on_host)
        if batch.device_tables is not None:
            return batch.device_tables[i, :n]
        ids = [0 if host else b for b, host in zip(batch.block_tables[i][:n], on_host)]
        return torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)

    @staticmethod
    def _host_columns(batch: SelectionInput, i: int, columns: list[int], device: torch.device) -> torch.Tensor:
        """The columns of sequence i's host blocks (its first num_blocks ones), on the device: the strategy's
        tensor where it has one."""
        if batch.host_columns is not None:
            return batch.host_columns[i, : len(columns)]
        return torch.tensor(columns, dtype=torch.int64).to(device, non_blocking=True)

    def sequence_selection(self, q: torch.Tensor, keys: torch.Tensor, kv_block: int) -> torch.Tensor:
        """q [n_q, Hq, D] (the last n_q of seq_len positions), keys [seq_len, Hk, D] -> bool
        [Hk, query blocks, blocks] at KV-block granularity, on q's device."""
        seq_len = keys.shape[0]
        granule = max(kv_block, self.block_size)
        blocks, first_granule = self.granule_mass(q, keys, granule)
        keep = self._fewest_covering(blocks)
        if self.cover == "head":  # [Hq, ...] -> [Hk, ...]
            keep = keep.view(keys.shape[1], -1, *keep.shape[1:]).any(1)
        keep.diagonal(first_granule, 1, 2).fill_(True)  # the diagonal (no index_put: its value is a host scalar)
        keep[:, :, 0].fill_(True)  # the sink
        if granule == kv_block:
            return keep
        n, first_block = -(-seq_len // kv_block), (seq_len - q.shape[0]) // kv_block
        query_granules = torch.arange(first_block, n, device=keep.device) * kv_block // granule - first_granule
        key_granules = torch.arange(n, device=keep.device) * kv_block // granule
        return keep[:, query_granules][:, :, key_granules]

    def granule_mass(self, q: torch.Tensor, keys: torch.Tensor, granule: int,
                     chunk: int = ESTIMATE_CHUNK) -> tuple[torch.Tensor, int]:
        """Estimated mass [Hk, query granules, key granules] ([Hq, ...] with cover "head") from the granule
        holding the first query, and that granule's index. Queries go in chunks of whole granules, so that
        the scores of a chunk ([Hq, chunk / stride, seq_len / stride]) stay small at long contexts; tiles
        never straddle chunks, nor granules (the stride divides the granule). With `fused_estimate` one Triton
        kernel per chunk (kernels/triton_xattention.py) makes the masses without the scores; the PyTorch path
        (antidiagonal_scores, then _granule_sums) is its reference. With `fused_granule_sums` the scores' softmax
        and granule sums are one Triton kernel (triton_xattention.softmax_granule_sums)."""
        seq_len = keys.shape[0]
        start = seq_len - q.shape[0]
        first_granule, num_granules = start // granule, -(-seq_len // granule)
        tiles_per_granule = granule // self.stride
        step = max(granule, chunk // granule * granule)
        fused = self._fused_estimate(q, granule)
        key_rows = None if fused is not None else key_tile_rows(keys, self.stride, q, self.one_copy_tiles)
        sums_kernel = self._granule_sums_kernel(q, granule)
        parts = []
        for lo in range(first_granule * granule, seq_len, step):
            hi = min(seq_len, lo + step)
            if fused is not None:
                mass = fused(q, keys, self.stride, granule, lo, hi)  # [Hq, rows, num_granules]
                parts.append(mass if self.cover == "head" else mass.view(keys.shape[1], -1, *mass.shape[1:]).sum(1))
                continue
            queries = slice(max(lo, start) - start, hi - start)
            rows, key_granules = -(-(hi - lo) // granule), -(-hi // granule)
            scores, first_tile = antidiagonal_scores(q[queries], keys[:hi], self.stride,
                                                     key_rows[:, : -(-hi // self.stride)], self.one_copy_tiles)
            lead = first_tile - lo // self.stride  # zero tiles before the first query, in its granule
            if sums_kernel is not None:
                sums = sums_kernel(scores.flatten(0, 1), lead, rows, key_granules, tiles_per_granule)
                sums = sums if self.cover == "head" else sums.view(keys.shape[1], -1, *sums.shape[1:]).sum(1)
            else:
                sums = self._granule_sums(scores, lead, rows, key_granules, tiles_per_granule)
            # the granules past this chunk's keys are added to the (granule-times smaller) sums, not to the tiles
            parts.append(F.pad(sums, (0, num_granules - key_granules)) if key_granules < num_granules else sums)
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)), first_granule

    def _granule_sums(self, scores: torch.Tensor, lead: int, rows: int, key_granules: int,
                      tiles_per_granule: int) -> torch.Tensor:
        """[Hk or Hq, rows, key_granules] float32 masses from scores [Hk, group, tiles, key tiles]: the softmax
        of each tile row, zero tiles before the first query and past the last ones to whole granules, one
        sum per granule (`softmax_granule_sums` is the one-kernel path)."""
        probs = scores.softmax(-1)  # in the scores' dtype: half-precision probabilities (float32 inside) on the GPU
        mass = probs.flatten(0, 1) if self.cover == "head" else probs.sum(1, dtype=torch.float32)
        pads = (0, key_granules * tiles_per_granule - mass.shape[2], lead, rows * tiles_per_granule - lead - mass.shape[1])
        whole = F.pad(mass, pads) if any(pads) else mass  # F.pad copies even when nothing is added
        return whole.view(mass.shape[0], rows, tiles_per_granule, key_granules, tiles_per_granule).sum(
            (2, 4), dtype=torch.float32)

    def _granule_sums_kernel(self, q: torch.Tensor, granule: int):
        """triton_xattention.softmax_granule_sums where it is asked for and applies (CUDA, the tiles per
        granule a power of two); else None."""
        tiles_per_granule = granule // self.stride
        if not (self.fused_granule_sums and q.is_cuda) or tiles_per_granule & (tiles_per_granule - 1):
            return None
        from nanovllm.kernels.triton_xattention import softmax_granule_sums

        return softmax_granule_sums

    def _fused_estimate(self, q: torch.Tensor, granule: int):
        """The Triton estimate (kernels/triton_xattention.py) where it is asked for and applies (the stride
        and granule powers of two); else None, and the PyTorch path, its reference, runs."""
        tiles_per_granule = granule // self.stride
        if not self.fused_estimate or self.stride & (self.stride - 1) or tiles_per_granule & (tiles_per_granule - 1):
            return None
        try:
            from nanovllm.kernels.triton_xattention import estimate_granule_mass
        except ImportError:
            return None
        return estimate_granule_mass

    def _fewest_covering(self, blocks: torch.Tensor) -> torch.Tensor:
        """Per row of [Hk, rows, key blocks] masses, the fewest key blocks whose mass reaches threshold."""
        if self.threshold >= 1.0:
            return blocks > 0
        ordered, order = blocks.sort(-1, descending=True)
        running = ordered.cumsum(-1)
        before = running - ordered  # mass of the blocks ranked above each one
        # a block without mass ranks after every one with mass: its `before` is the row's total, never below a
        # threshold < 1 of it; nor is anything in a row without mass. `order` permutes each row: every entry is written.
        covering = before < running[..., -1:] * self.threshold
        return torch.empty_like(covering).scatter_(-1, order, covering)


def quest_top_reference(scores: torch.Tensor, ends: torch.Tensor, sink: int, budget: int, recent: int) -> torch.Tensor:
    """Kept columns as positions [B, Hk, sink + budget + recent] (-1 for none) of scores [B, Hk, C] (-inf:
    no keys) with ends [B] columns per row: the sink's, the top `budget` of the middle [sink, end - recent)
    sorted, the recent ones. In order in every row whose middle holds more than `budget` candidates; in
    other rows the -1 may come between."""
    num_columns, num_kv_heads = scores.shape[-1], scores.shape[1]
    ends = ends[:, None]
    column = torch.arange(num_columns, device=scores.device)
    middle = (column >= sink) & (column < ends - recent)  # [B, C]
    top = scores.masked_fill(~middle[:, None, :], float("-inf")).topk(budget, dim=-1, sorted=False)
    top = top.indices.masked_fill(top.values == float("-inf"), num_columns).sort(-1).values
    index = torch.arange(sink + recent, device=scores.device)
    is_sink = index < sink
    fixed = torch.where(is_sink, index, ends - recent - sink + index)  # [B, sink + recent]
    fixed = fixed.masked_fill((fixed >= ends) | (~is_sink & (fixed < sink)), num_columns)[:, None, :]
    fixed = fixed.expand(-1, num_kv_heads, -1)
    kept = torch.cat([fixed[..., :sink], top, fixed[..., sink:]], -1)
    return kept.masked_fill(kept >= num_columns, -1)


def _pad_rows(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """x [rows, ...] with zero rows added before and after; x itself when none are (F.pad would copy it)."""
    if not before and not after:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (before, after))


def _work_dtype(q: torch.Tensor) -> torch.dtype:
    return q.dtype if q.is_cuda else torch.float32  # half-precision matmuls on the tensor cores


def key_tile_rows(keys: torch.Tensor, stride: int, q: torch.Tensor, one_copy: bool = False) -> torch.Tensor:
    """keys [seq_len, Hk, D] as [Hk, key tiles, stride * D]: each tile's rows side by side in reverse order
    (the last tile padded with zero rows), in the matmul dtype of queries like q. Reversed here, once per
    layer, so that a query tile's rows pair with them in order (its antidiagonal) without a flip per chunk.
    one_copy: one gather of the rows in their new order and layout (then the padding zeroed) instead of a
    flip and a copy to the new layout (the same tensor)."""
    seq_len, num_kv_heads, dim = keys.shape
    num_key_tiles = -(-seq_len // stride)
    if one_copy:
        order = torch.arange(num_key_tiles * stride, device=keys.device).view(num_key_tiles, stride).flip(1)
        rows = keys.to(_work_dtype(q)).permute(1, 0, 2).index_select(1, order.flatten().clamp_(max=seq_len - 1))
        pad = num_key_tiles * stride - seq_len  # past the end: the last tile's first `pad` rows, once reversed
        if pad:
            rows[:, rows.shape[1] - stride : rows.shape[1] - stride + pad].zero_()
        return rows.view(num_kv_heads, num_key_tiles, stride * dim)
    padded = _pad_rows(keys.to(_work_dtype(q)), 0, num_key_tiles * stride - seq_len)
    return padded.view(num_key_tiles, stride, num_kv_heads, dim).flip(1).permute(2, 0, 1, 3).reshape(
        num_kv_heads, num_key_tiles, stride * dim)


def query_tile_rows(q: torch.Tensor, stride: int, num_kv_heads: int, lead: int, num_tiles: int) -> torch.Tensor:
    """q [n_q, Hq, D] divided by sqrt(D) * stride, as [Hk, group * tiles, stride * D] in the matmul dtype: each
    query tile's rows side by side, `lead` zero rows before the first query and zero rows after the last to
    whole tiles. One kernel writes the scaled queries into that layout (on the CPU a dtype copy comes first)."""
    n_q, num_heads, dim = q.shape
    group = num_heads // num_kv_heads
    rows = torch.empty(num_kv_heads, group, num_tiles * stride, dim, dtype=_work_dtype(q), device=q.device)
    rows[:, :, :lead].zero_()
    rows[:, :, lead + n_q :].zero_()
    source = q.to(rows.dtype).view(n_q, num_kv_heads, group, dim).permute(1, 2, 0, 3)
    torch.div(source, dim**0.5 * stride, out=rows[:, :, lead : lead + n_q])
    return rows.view(num_kv_heads, group * num_tiles, stride * dim)


def antidiagonal_scores(q: torch.Tensor, keys: torch.Tensor, stride: int, key_rows: torch.Tensor | None = None,
                        one_copy: bool = False) -> tuple[torch.Tensor, int]:
    """Scores [Hk, group, query tiles, key tiles] of (query tile, key tile) pairs of `stride` positions
    (-inf for the causally hidden ones) and the first query tile's index. A pair's score is the sum over
    its tile's antidiagonal of q.k (query row j with key row stride-1-j), scaled like one dot product.
    key_rows: the keys' `key_tile_rows`, where the caller has them (a view of a longer sequence's is not
    copied again). one_copy: the queries scaled into their tile layout by one kernel (`query_tile_rows`)."""
    n_q, num_heads, dim = q.shape
    seq_len, num_kv_heads = keys.shape[:2]
    start = seq_len - n_q
    first_tile, num_key_tiles = start // stride, -(-seq_len // stride)
    num_query_tiles = num_key_tiles - first_tile
    lead = start - first_tile * stride  # zero rows before the first query, in its tile
    group = num_heads // num_kv_heads
    if one_copy:
        q_rows = query_tile_rows(q, stride, num_kv_heads, lead, num_query_tiles)
    else:
        queries = _pad_rows(q.to(_work_dtype(q)) / (dim**0.5 * stride), lead, num_query_tiles * stride - lead - n_q)
        q_tiles = queries.view(num_query_tiles, stride, num_kv_heads, group, dim)
        q_rows = q_tiles.permute(2, 3, 0, 1, 4).reshape(num_kv_heads, group * num_query_tiles, stride * dim)
    k_rows = key_tile_rows(keys, stride, q, one_copy) if key_rows is None else key_rows
    if k_rows.shape[1] != num_key_tiles:
        raise ValueError(f"key_rows hold {k_rows.shape[1]} tiles; the keys make {num_key_tiles}")
    scores = torch.bmm(q_rows, k_rows.transpose(1, 2)).view(num_kv_heads, group, num_query_tiles, num_key_tiles)
    # query tile t sees key tiles <= first_tile + t: hidden ones only among the last num_query_tiles columns
    hidden = torch.ones(num_query_tiles, num_query_tiles, dtype=torch.bool, device=q.device).triu_(1)
    scores[..., first_tile:].masked_fill_(hidden, float("-inf"))
    return scores, first_tile


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


@contextlib.contextmanager
def _min_context_zero(selector: QuestSelector | XAttentionSelector) -> Iterator[None]:
    """selector.min_context at 0 for the block (BlockSelector.selecting_at_any_length)."""
    saved, selector.min_context = selector.min_context, 0
    try:
        yield
    finally:
        selector.min_context = saved


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
