"""Decode steps a block selector narrows in every row (Quest over long sequences), built from static
tensors so that they run in CUDA graphs like dense decode steps.

`BlockSelector.narrowed_decode` tells the planner, on the host, that each row of a decode step keeps
`narrowed_blocks` blocks per KV head in every layer the selector narrows. `NarrowedDecodeKV` then makes
the whole selection from the graph's inputs: the block tables (a host block as RING_BASE + its host
id, read in place from pinned memory by the decode kernel), the KV lengths and the layer's queries. It
builds per-KV-head tables of a fixed width and counts, in a static buffer, the blocks each row read and
the host blocks among them (read once after the step). A selector that selects pages (Quest with
`quest_page_select`) keeps columns of `decode_page_size` tokens: the tables name pages of the pools
viewed in pages (`page_views`; host pages read in place too) and the counts are in pages. Layers the selector
reads whole attend over the full tables, their host blocks from the device mirror where the pool keeps one
(offload/host_pool.py). A selector with `host_key_codes` has the kept host pages' keys read from its int8 copy
on the device: their values alone cross PCIe, counted as half a column's bytes.
Without graphs (on the CPU) the same access runs eagerly, which is how it is tested in CI.
"""
from __future__ import annotations

import torch

from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.offload.host_pool import RING_BASE, HostKVPool
from nanovllm.kernels.reference import HostKV
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.block_selector import BlockSelector, DecodeLayout
from nanovllm.layers.kv_access import KVAccess, column_tables, page_views

GRAPH_SCRATCH_BYTES = 2 * 2**30  # the most a narrowed graph's selection may hold at once (bounds gathered per row)


class NarrowedDecode:
    """What narrowed decode steps share for the engine's life: the selector, the pools and the count
    buffer [rows, 3] (columns read, host columns read in place, host columns read half: keys alone by the
    selection, or values alone where the keys come from the selector's key codes; summed over layers and KV
    heads)."""

    def __init__(self, selector: BlockSelector, cache: PagedKVCache, backend: AttentionBackend,
                 host_pool: HostKVPool | None, block_size: int, max_rows: int):
        self.selector, self.cache, self.backend, self.host_pool = selector, cache, backend, host_pool
        self.block_size = block_size
        self.counts = torch.zeros(max_rows, 3, dtype=torch.int64, device=cache.data.device)
        self.captured_with: BlockSelector | None = None  # the selector the narrowed graphs were captured with
        self.captured_shape = ()  # and what the graphs baked in of it (BlockSelector.narrowing)

    @property
    def enabled(self) -> bool:
        return self.selector.narrows

    def captured(self, selector: BlockSelector, bucket: int, graphs) -> bool:
        """Whether a narrowed graph of this bucket runs `selector`'s narrowing (a selector swapped in later,
        or one whose budget or rerank changed since the capture, runs eagerly)."""
        return selector is self.captured_with and bucket in graphs.narrowed_graphs and \
            self.captured_shape == selector.narrowing(self.block_size)

    def capturing(self) -> None:
        """The narrowed graphs are being captured with the current selector."""
        self.captured_with, self.captured_shape = self.selector, self.selector.narrowing(self.block_size)

    @property
    def columns_per_block(self) -> int:
        """The selector's columns (the counts' unit) per KV block: 1, or its pages per block."""
        return self.block_size // self.selector.decode_page_size(self.block_size)

    def kv(self, meta: AttentionMetadata) -> NarrowedDecodeKV:
        return NarrowedDecodeKV(self, meta)

    def graph_rows(self, max_blocks_per_seq: int) -> int:
        """The most rows a narrowed graph takes, for its selection's scratch to stay in GRAPH_SCRATCH_BYTES."""
        return GRAPH_SCRATCH_BYTES // max(1, self.selector.narrow_scratch_bytes(max_blocks_per_seq))

    @staticmethod
    def tables(block_tables: list[list[int]], on_host: list[list[bool]] | None) -> list[list[int]]:
        """The kernel's block tables: host blocks as RING_BASE + their host id."""
        if on_host is None:
            return block_tables
        return [[RING_BASE + b if h else b for b, h in zip(t, f)] for t, f in zip(block_tables, on_host)]

    def second_pool(self, layer: int, whole: bool) -> tuple[HostKV | None, bool]:
        """Where this layer's host blocks are read: (second pool, True when that is pinned host memory
        read over PCIe). A layer read whole uses the device mirror when the pool keeps one for it."""
        pool = self.host_pool
        if pool is None:
            return None, False
        if whole and layer < pool.mirrored_layers:
            return HostKV(pool.mirror[0, layer], pool.mirror[1, layer], RING_BASE), False
        codes = None if whole else self.selector.host_key_codes(layer)
        return HostKV(pool.host[0, layer], pool.host[1, layer], RING_BASE, codes), True


class NarrowedDecodeKV(KVAccess):
    """One narrowed decode step (module docstring); meta: the step's (or graph's) decode metadata."""

    def __init__(self, shared: NarrowedDecode, meta: AttentionMetadata):
        self.shared, self.meta = shared, meta
        self.layout: DecodeLayout | None = None
        self.counts = shared.counts[: meta.num_seqs]

    def attend(self, layer, q, k, v, scale):
        s, meta = self.shared, self.meta
        s.cache.write(layer, k, v, meta.slot_mapping)
        k_cache, v_cache = s.cache.layer(layer)
        num_kv_heads = k_cache.shape[2]
        base = RING_BASE if s.host_pool is not None else None
        if self.layout is None:  # the first layer: the step's layout and fresh counts
            self.layout = DecodeLayout.from_tensors(meta.block_tables_tensor, meta.seq_lens_tensor, s.block_size, base)
            self.counts.zero_()
        kept = s.selector.narrow(layer, q, num_kv_heads, self.layout, self.counts[:, 2])
        second, over_pcie = s.second_pool(layer, whole=kept is None)
        if kept is None:  # every block: counted as its columns
            columns, attend_meta = self.layout, meta
            self.counts[:, 0] += self.layout.num_blocks * (num_kv_heads * s.columns_per_block)
            if over_pcie:
                self.counts[:, 1] += columns.on_host.sum(1) * (num_kv_heads * s.columns_per_block)
        else:
            columns = self.layout.at(s.selector.decode_page_size(s.block_size))
            host_column = 2 if second is not None and second.key_codes is not None else 1  # values alone: half
            attend_meta = self._narrowed_meta(columns, kept, RING_BASE if over_pcie else None, host_column)
        k_cache, v_cache, second = page_views(columns.block_size, k_cache, v_cache, second)
        return s.backend.forward(q, k_cache, v_cache, attend_meta, scale, host_kv=second)

    def _narrowed_meta(self, columns: DecodeLayout, kept: torch.Tensor, host_base: int | None,
                       host_column: int = 1) -> AttentionMetadata:
        """Per-KV-head decode metadata over the kept columns (blocks or pages, as positions), tables of a fixed
        width; the columns kept (and those read from the host: ids >= host_base, to counts[:, host_column]) are
        added to the counts."""
        meta, page_size, width = self.meta, columns.block_size, kept.shape[-1]
        tables, lengths = tables_and_counts(columns, kept, self.counts, host_base, host_column)
        return AttentionMetadata(
            query_lens=meta.query_lens, seq_lens=[width * page_size] * meta.num_seqs, block_tables=[],
            slot_mapping=meta.slot_mapping, cu_query_lens=meta.cu_query_lens,
            seq_lens_tensor=lengths, block_tables_tensor=tables, block_size=page_size)


def tables_and_counts(columns: DecodeLayout, kept: torch.Tensor, counts: torch.Tensor, host_base: int | None,
                      host_column: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """column_tables (lengths as int32) of the kept positions, the kept columns added to counts[:, 0] and,
    unless host_base is None, those read from the host (ids >= host_base) to counts[:, host_column]. On CUDA
    one Triton kernel (kernels/triton_narrowed.py) instead of a dozen small ones per layer."""
    if kept.is_cuda:
        from nanovllm.kernels.triton_narrowed import narrowed_tables

        return narrowed_tables(kept, columns.ids, columns.seq_lens, columns.num_blocks, columns.block_size, counts,
                               host_base, host_column)
    tables, lengths = column_tables(columns, kept, columns.block_size)
    counts[:, 0] += (kept >= 0).sum((1, 2))
    if host_base is not None:  # padding is -1
        counts[:, host_column] += (tables >= host_base).sum((1, 2))
    return tables, lengths.to(torch.int32)
