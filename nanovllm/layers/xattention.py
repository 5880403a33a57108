"""XAttention: the prefill policy of block-sparse attention.

`XAttentionSelector` (prefill): antidiagonal scoring. Queries and keys are cut into tiles of
`stride` positions; a (query tile, key tile) pair scores the sum of q.k over the tile's antidiagonal
(one stride-th of the full Q.K^T work), softmax per query head over the visible key tiles, the
probabilities summed over the query heads of each KV-head group (K is never repeated per query head)
and over `block_size`-token blocks. Per KV head and block of queries, the fewest key blocks that
cover `threshold` of that estimated mass are kept, with the sink block and the diagonal, and the blocks
the options force (`with_forced_blocks`: all of them for the prompt's last `dense_last_blocks` query
blocks, a window of `local_blocks` before each one). Host blocks' K (never V) is read for the estimate.
Selections are made at max(block_size, KV block) tokens.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanovllm.layers.block_selector import BlockSelector, Selection, SelectionInput, min_context_at_zero

if TYPE_CHECKING:
    from nanovllm.engine.kv_cache import PagedKVCache

ESTIMATE_CHUNK = 8192  # XAttention's estimate takes queries in chunks of about this many tokens
FUSED_ESTIMATE_CHUNK = 32768  # the same for the Triton estimate, whose scratch is granule/stride times smaller


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
        # the Triton estimate (kernels/triton_xattention.py: the scores as a GEMM over tensor descriptors, their
        # softmax and granule sums in its epilogue) instead of the PyTorch path: None (the default) for 16-bit CUDA
        # queries, True wherever it applies (the CPU interpreter's tests), False never. 7.3 vs 11.8 ms a layer
        # over a 128K prefill on an H100 (docs/BENCHMARKS.md)
        self.fused_estimate: bool | None = None
        # the softmax and the granule sums of the PyTorch path's scores in one Triton kernel
        # (triton_xattention.softmax_granule_sums) on CUDA: 13.1 vs 17.4 ms per 128K estimate on the H200
        self.fused_granule_sums = True
        # the estimate's key and query tiles made by one gather / one scaling kernel each instead of a flip and
        # layout copies (key_tile_rows, query_tile_rows), the same tensors: 12.3 vs 13.4 ms per 128K estimate
        # on the H200 (docs/BENCHMARKS.md)
        self.one_copy_tiles = True

    def warm_up(self, num_kv_heads: int, device: torch.device) -> None:
        """Compiles the estimate's kernel variant of this engine (the Triton estimate's: dtype, head_dim, stride,
        granule; else the granule-sums kernel's: the scores' dtype, the tiles per granule): the engine's warm-up
        steps are below min_context or too short to select."""
        granule = max(self.cache.data.shape[3], self.block_size)
        q = torch.zeros(2 * granule, num_kv_heads, self.cache.data.shape[-1], dtype=self.cache.data.dtype,
                        device=device)
        fused = self._fused_estimate(q, granule)
        if fused is not None:
            fused(q, q, self.stride, granule, 0, q.shape[0])
            return
        sums = self._granule_sums_kernel(q, granule)
        if sums is not None:
            tiles = granule // self.stride
            sums(torch.zeros(1, tiles, tiles, dtype=_work_dtype(q), device=device), 0, 1, 1, tiles)

    def selecting_at_any_length(self) -> contextlib.AbstractContextManager[None]:
        return min_context_at_zero(self)

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
        host = [c for c in range(n) if flags[c]]
        if not host and _consecutive(table[:n]):  # the pool's blocks in order: a view, not a gather
            return k_cache[table[0] : table[0] + n].flatten(0, 1)[: batch.seq_lens[i]]
        blocks = k_cache.index_select(0, self._device_ids(batch, i, flags, k_cache.device))
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
                     chunk: int | None = None) -> tuple[torch.Tensor, int]:
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
        fused = self._fused_estimate(q, granule)
        chunk = chunk or (ESTIMATE_CHUNK if fused is None else FUSED_ESTIMATE_CHUNK)
        step = max(granule, chunk // granule * granule)
        key_rows = None if fused is not None else key_tile_rows(keys, self.stride, q, self.one_copy_tiles)
        sums_kernel = None if fused is not None else self._granule_sums_kernel(q, granule)
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
        pads = (0, key_granules * tiles_per_granule - mass.shape[2],
                lead, rows * tiles_per_granule - lead - mass.shape[1])
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
        """The Triton estimate (kernels/triton_xattention.py) where it is asked for and applies (its shapes,
        and tensor descriptors: Hopper or newer, or the CPU interpreter); else None, and the PyTorch path, its
        reference, runs."""
        if self.fused_estimate is False or self.fused_estimate is None and not (q.is_cuda and q.element_size() == 2):
            return None
        try:
            from nanovllm.kernels.triton_paged_attention import _has_tma
            from nanovllm.kernels.triton_xattention import estimate_applies, estimate_granule_mass
        except ImportError:
            return None
        return estimate_granule_mass if _has_tma(q.device) and estimate_applies(q, self.stride, granule) else None

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


def _consecutive(ids: list[int]) -> bool:
    """ids are n consecutive ascending integers."""
    return bool(ids) and ids == list(range(ids[0], ids[0] + len(ids)))


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
