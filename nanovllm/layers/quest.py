"""Quest: the decode policy of block-sparse attention.

`QuestSelector` (decode): per 16-token page, the elementwise min and max of its keys (kept through
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
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from nanovllm.config import QUEST_RERANK_SCORES
from nanovllm.layers.block_metadata import BlockKeyBounds, BlockKeyCopy
from nanovllm.layers.block_selector import BlockSelector, DecodeLayout, Selection, SelectionInput, min_context_at_zero

if TYPE_CHECKING:
    from nanovllm.engine.step_plan import StepPlan
    from nanovllm.kernels.reference import KeyCodes

QUEST_PAGE_SIZE = 16


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
        return min_context_at_zero(self)

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
