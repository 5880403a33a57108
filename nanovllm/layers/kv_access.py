"""KV access: how one step's attention layers reach their KV, wherever it lives.

The model calls `KVAccess.attend(layer, q, k, v, scale)` once per layer, in order; that is the only
way it touches the KV cache (where `write_target` names the layer's caches and slots, the op that makes k
stores k and v there itself, and the model calls `attend_written` instead). Each implementation is one
strategy: `DeviceKV` here (every block in the device pool), and in engine/offload/ the strategies for KV
partly in pinned host memory (one pass over a ring slot, host pieces merged by log-sum-exp, copies staged
inside CUDA graphs). Every strategy first stores the new K/V through `PagedKVCache.write` (the one KV-write
point, with its hooks; or tells the hooks through `PagedKVCache.written`), then asks the step's block
selector which blocks each KV head attends to.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from nanovllm.kernels.reference import HostKV, KeyCodes
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.block_selector import (BlockSelector, DecodeLayout, DenseSelector, Selection, SelectionInput,
                                            SparseStats, with_query_blocks)

if TYPE_CHECKING:
    from nanovllm.engine.kv_cache import PagedKVCache


class KVAccess(ABC):
    """One step's KV for every layer."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store this layer's new k, v [T, Hk, D]; return attention of q [T, Hq, D] over the step's KV."""

    def write_target(self, layer: int) -> WriteTarget | None:
        """Where attend() would store this layer's new K/V, when the caller may store them itself (fused into the
        op that makes k; then attend_written, not attend); None: attend() stores them (offload strategies order
        the write after copies out of the device blocks it reuses)."""
        return None

    def attend_written(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> torch.Tensor:
        """attend() once the caller stored k, v at write_target(layer)."""
        raise NotImplementedError(f"{type(self).__name__} has no write target")


class WriteTarget(NamedTuple):
    """A layer's caches [num_blocks, block_size, Hk, D] and the flat slots [T] of the step's new tokens."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor


class DeviceKV(KVAccess):
    """Every block in the device pool: the backend's paged attention over the step's block tables."""

    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 selector: BlockSelector | None = None, stats: SparseStats | None = None,
                 prefill_ends: list[int] | None = None):
        self.cache, self.backend, self.meta = cache, backend, meta
        self.selector, self.stats, self.prefill_ends = selector or DenseSelector(), stats, prefill_ends
        self.layout: DecodeLayout | None = None
        self.group_plans: dict[tuple[int | None, ...], tuple[GroupPlan, torch.Tensor]] = {}  # with their pool ids
        self.mixed = MixedRows(meta.query_lens, cache.data.device, self._part) \
            if MixedRows.wanted(self.selector, meta.query_lens, meta.block_size) else None

    def _part(self, seqs: list[int]) -> DeviceKV:
        """The step's sequences seqs as a step of their own (their K/V stored by this one), counted in stats."""
        m, pick = self.meta, lambda values: [values[i] for i in seqs]  # noqa: E731
        meta = self.backend.build_metadata(pick(m.query_lens), pick(m.seq_lens), pick(m.block_tables), [],
                                           m.block_size, self.cache.data.device)
        return DeviceKV(self.cache, self.backend, meta, self.selector,
                        None if self.stats is None else self.stats.part(seqs),
                        None if self.prefill_ends is None else pick(self.prefill_ends))

    def _layout(self, batch: SelectionInput) -> DecodeLayout:
        if self.layout is None:
            self.layout = DecodeLayout.build(batch, self.cache.data.device)
        return self.layout

    def attend(self, layer, q, k, v, scale):
        self.cache.write(layer, k, v, self.meta.slot_mapping)
        return self.attend_stored(layer, q, scale)

    def write_target(self, layer: int) -> WriteTarget:
        return WriteTarget(*self.cache.layer(layer), self.meta.slot_mapping)

    def attend_written(self, layer, q, k, v, scale):
        self.cache.written(layer, k, v, self.meta.slot_mapping)
        return self.attend_stored(layer, q, scale)

    def attend_stored(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """attend() once the layer's new K/V are stored."""
        if self.mixed is not None:
            return self.mixed.attend(layer, q, scale)
        k_cache, v_cache = self.cache.layer(layer)
        if self.selector.dense:
            return self.backend.forward(q, k_cache, v_cache, self.meta, scale)
        batch = SelectionInput(self.meta.query_lens, self.meta.seq_lens, self.meta.block_size, self.meta.block_tables,
                               stats=self.stats, device_tables=self.meta.block_tables_tensor,
                               prefill_ends=self.prefill_ends)
        selection = select_for_step(self.selector, layer, q, k_cache.shape[2], batch, self._layout)
        if selection is None:
            return self.backend.forward(q, k_cache, v_cache, self.meta, scale)
        if isinstance(selection, DeviceSelection):
            k_pages, v_pages, _ = page_views(selection.layout.block_size, k_cache, v_cache)
            return self.backend.forward(q, k_pages, v_pages, decode_metadata(self.backend, selection), scale)
        key = group_plan_key(selection)
        if key not in self.group_plans:  # the same for every layer of the step
            plan = GroupPlan(batch, selection)
            self.group_plans[key] = plan, plan.groups(selection).pool_ids(
                [torch.tensor(t, dtype=torch.int64) for t in batch.block_tables])
        plan, ids = self.group_plans[key]
        meta = group_metadata(self.backend, plan.groups(selection), ids, self.meta.block_size, q.device,
                              shared=plan.shared_metadata)
        return self.backend.forward(q, k_cache, v_cache, meta, scale)


class StoredKV(Protocol):
    """A strategy's attention over K/V already stored: one part of a mixed step (MixedRows)."""

    def attend_stored(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor: ...


class MixedRows:
    """A mixed step (decode rows beside prefill rows) under a selector whose decode rows select pages
    (decode_page_size below the KV block): two parts, each attended as a step of its own, the decode rows
    as a decode-only step does (page tables over the pools viewed in pages, host pages read in place) and
    the prefill rows as before (blocks); each part's output is copied back to its query rows (tensor
    operations, no host sync). part(seqs): the strategy for those of the step's sequences."""

    def __init__(self, query_lens: list[int], device: torch.device, part: Callable[[list[int]], StoredKV]):
        starts = list(itertools.accumulate(query_lens, initial=0))
        parts = [[i for i, n in enumerate(query_lens) if n == 1], [i for i, n in enumerate(query_lens) if n > 1]]
        self.rows = [torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])],
                                  dtype=torch.int64).to(device, non_blocking=True) for seqs in parts]
        self.parts = [part(seqs) for seqs in parts]

    @staticmethod
    def wanted(selector: BlockSelector, query_lens: list[int], block_size: int) -> bool:
        """A mixed step whose decode rows the selector would read in pages."""
        return selector.decode_page_size(block_size) < block_size and 1 in query_lens and max(query_lens) > 1

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        outs = [kv.attend_stored(layer, q.index_select(0, rows), scale) for kv, rows in zip(self.parts, self.rows)]
        out = outs[0].new_empty(q.shape)
        for rows, part in zip(self.rows, outs):
            out.index_copy_(0, rows, part)
        return out


@dataclass
class DeviceSelection:
    """A decode step's selection made on the device: keep [B, Hk, columns] over layout's columns (blocks,
    or pages of layout.block_size tokens), and the most columns any KV head keeps (the tables' width,
    known on the host)."""

    layout: DecodeLayout
    keep: torch.Tensor
    widest: int


def select_for_step(selector: BlockSelector, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput,
                    layout_of: Callable[[SelectionInput], DecodeLayout], bytes_per_host_pair: int = 0,
                    read_per_host_pair: int | None = None) -> Selection | DeviceSelection | None:
    """Decode steps go to the selector's device-side selection where it has one (no host sync per layer);
    other steps, and selectors without it, to select_blocks. Counts go to batch.stats either way: a host
    (block, KV head) pair a decode step reads in place as read_per_host_pair bytes (default: all of them;
    half when its keys come from the selector's key codes)."""
    if max(batch.query_lens) == 1:
        layout = layout_of(batch)
        key_bytes = bytes_per_host_pair // (batch.block_size // selector.decode_page_size(batch.block_size)) // 2
        key_reads = None if batch.stats is None else batch.stats.key_reads(q.device, key_bytes)
        chosen = selector.decode_keep(layer, q, num_kv_heads, layout, key_reads)
        if chosen is not NotImplemented:
            if chosen is None:
                if batch.stats is not None:
                    batch.stats.add(batch, None, num_kv_heads)
                return None
            keep, widest = chosen
            columns = layout.at(selector.decode_page_size(batch.block_size))
            if batch.stats is not None:
                read = bytes_per_host_pair if read_per_host_pair is None else read_per_host_pair
                batch.stats.add_decode_on_device(columns, keep, read)
            return DeviceSelection(columns, keep, widest)
    return select_blocks(selector, layer, q, num_kv_heads, batch)


def decode_metadata(backend: AttentionBackend, selection: DeviceSelection) -> AttentionMetadata:
    """Per-KV-head decode metadata from a device selection, built on the device: each head's kept blocks
    (pages) in position order (the most recent last, the dropped ones full and before it), over the pools
    viewed in the selection's columns (`page_views`)."""
    layout, block_size = selection.layout, selection.layout.block_size
    tables, lengths = head_tables(layout, selection.keep, selection.widest, block_size)
    return backend.build_head_metadata([1] * tables.shape[0], lengths, tables, block_size, tables.device,
                                       max_seq_lens=layout.batch.seq_lens)


def page_views(page_size: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
               host_kv: HostKV | None = None) -> tuple[torch.Tensor, torch.Tensor, HostKV | None]:
    """One layer's pools [blocks, block_size, Hk, D] (device, and a second pool: ring or pinned host) viewed
    as [blocks * P, page_size, Hk, D]: the same memory, page p of block b is page b * P + p."""
    def view(t: torch.Tensor) -> torch.Tensor:
        return t if t.shape[1] == page_size else t.view(-1, page_size, *t.shape[2:])

    host, codes = host_kv, host_kv and host_kv.key_codes
    if host_kv is not None:
        host = HostKV(view(host_kv.k), view(host_kv.v), host_kv.base,
                      codes and KeyCodes(view(codes.codes), codes.scales.view(-1, page_size, codes.scales.shape[-1])))
    return view(k_cache), view(v_cache), host


def head_tables(layout: DecodeLayout, keep: torch.Tensor, width: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and KV head, the kept blocks of keep [B, Hk, blocks] in position order as kernel table
    entries [B, Hk, width] (padded with -1), and the KV length they hold [B, Hk] (the dropped blocks are
    full and precede the most recent one, which is kept). Tensor operations of fixed shapes only (no
    sort): each kept block goes to its rank among the kept ones, the dropped ones to a spare column."""
    rank = keep.cumsum(-1) - 1
    target = torch.where(keep & (rank < width), rank, width)
    tables = torch.full((*keep.shape[:2], width + 1), -1, dtype=layout.ids.dtype, device=keep.device)
    tables.scatter_(-1, target, layout.ids[:, None, :].expand_as(keep))
    tables = tables[..., :width].contiguous()
    kept = keep.sum(-1)  # [B, Hk]
    lengths = layout.seq_lens[:, None] - (layout.valid.sum(1, keepdim=True) - kept) * block_size
    return tables, lengths


def column_tables(layout: DecodeLayout, kept: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """head_tables for kept columns given as positions [B, Hk, W] (ascending, then -1: BlockSelector.narrow):
    the kernel's table entries [B, Hk, W] (-1 padded) and the KV length each head holds [B, Hk]."""
    held = kept >= 0
    ids = layout.ids[:, None, :].expand(-1, kept.shape[1], -1)
    tables = torch.gather(ids, 2, kept.clamp(min=0)).masked_fill(~held, -1)
    lengths = layout.seq_lens[:, None] - (layout.num_blocks[:, None] - held.sum(-1)) * block_size
    return tables, lengths


def select_blocks(selector: BlockSelector, layer: int, q: torch.Tensor, num_kv_heads: int,
                  batch: SelectionInput) -> Selection | None:
    """The selector's masks with the query blocks forced on; None for every block (dense). The attended
    share is counted in batch.stats."""
    if selector.dense:
        return None
    selection = selector.select(layer, q, num_kv_heads, batch)
    if selection is not None and all(m is None for m in selection):
        selection = None
    selection = None if selection is None else with_query_blocks(selection, batch)
    if batch.stats is not None:
        batch.stats.add(batch, selection, num_kv_heads)
    return selection


@dataclass
class QueryGroups:
    """The step's query rows, in order, as groups of consecutive rows of one sequence that attend to the
    same blocks: group g is `count[g]` rows of sequence `seq[g]`, causal over its first end[g] positions;
    mask[g, head, c]: block c of the sequence attended (False past the group's ceil(end / block_size)
    visible blocks)."""

    seq: list[int]
    count: list[int]
    ends: list[int]  # end of each group, on the host
    # [G, 1] int64 on the mask's device: end - visible blocks * block_size, a head's KV length (causal) less
    # its kept blocks' tokens
    short_of_kept: torch.Tensor
    mask: torch.Tensor  # [G, Hk, max blocks] bool

    def visible_blocks(self, block_size: int) -> list[int]:
        return [-(-e // block_size) for e in self.ends]

    def pool_ids(self, per_sequence: list[torch.Tensor]) -> torch.Tensor:
        """[G, max blocks]: each group's row of per_sequence[seq] (block c -> id in a pool, -1: not there)."""
        ids = torch.full((len(per_sequence), self.mask.shape[-1]), -1, dtype=torch.int64)
        for i, row in enumerate(per_sequence):
            ids[i, : row.numel()] = row[: self.mask.shape[-1]]
        return ids[torch.tensor(self.seq, dtype=torch.int64)].to(self.mask.device, non_blocking=True)


class GroupPlan:
    """A step's query groups for selections of one shape (per sequence None, a [Hk, blocks] or a [Hk, query
    blocks, blocks] mask), built once per step: one group per sequence for a [Hk, blocks] mask or None (every
    block), one per query block for [Hk, query blocks, blocks]; their ends, and the None rows' masks (decode
    rows beside a sparse prefill, say: switched on together, no tensor operation each). Per layer only the
    masks are put together (`groups`)."""

    def __init__(self, batch: SelectionInput, selection: Selection):
        masked = [m for m in selection if m is not None]
        self.num_kv_heads, self.device = masked[0].shape[0], masked[0].device
        self.width = max(batch.num_blocks(i) for i in range(len(selection)))
        self.seq, self.count, self.ends = [], [], []
        self.parts: list[int | torch.Tensor] = []  # per run of groups: a masked sequence, or the None rows' masks
        whole: list[int] = []  # blocks of the current run of None rows
        for i, mask in enumerate(selection):
            if mask is None:
                whole.append(batch.num_blocks(i))
            else:
                self._close_run(whole)
                self.parts.append(i)
            if mask is None or mask.dim() == 2:
                self._add_group(i, batch.query_lens[i], batch.seq_lens[i])
            else:
                self._add_query_blocks(batch, i, mask.shape[1])
        self._close_run(whole)
        bs = batch.block_size
        short = [e - -(-e // bs) * bs for e in self.ends]
        self.short_of_kept = torch.tensor(short, dtype=torch.int64)[:, None].to(self.device, non_blocking=True)
        self.first_query_block = [batch.first_query_block(i) for i in range(len(selection))]
        # the layers' causal metadata have the same query counts and length bounds (the ends): what
        # build_head_metadata can share across them
        self.shared_metadata: dict = {}

    def _add_group(self, seq: int, count: int, end: int) -> None:
        self.seq.append(seq)
        self.count.append(count)
        self.ends.append(end)

    def _add_query_blocks(self, batch: SelectionInput, i: int, num_rows: int) -> None:
        """One group per block holding sequence i's queries: its rows, causal up to the block's end."""
        first, bs, end, count = batch.first_query_block(i), batch.block_size, batch.seq_lens[i], batch.query_lens[i]
        for b in range(first, first + num_rows):
            upper, lower = min((b + 1) * bs, end), max(b * bs, end - count)
            self._add_group(i, upper - lower, upper)

    def _close_run(self, blocks: list[int]) -> None:
        if not blocks:
            return
        counts = torch.tensor(blocks, dtype=torch.int64).to(self.device, non_blocking=True)
        prefix = torch.arange(self.width, device=self.device)[None, :] < counts[:, None]
        self.parts.append(prefix[:, None, :].expand(-1, self.num_kv_heads, -1))
        blocks.clear()

    def groups(self, selection: Selection) -> QueryGroups:
        """This layer's groups: the masks of `selection` (of this plan's shape) in the groups' rows."""
        rows = [part if isinstance(part, torch.Tensor) else self._rows(part, selection[part]) for part in self.parts]
        mask = rows[0] if len(rows) == 1 else torch.cat(rows)
        return QueryGroups(self.seq, self.count, self.ends, self.short_of_kept, mask)

    def _rows(self, i: int, mask: torch.Tensor) -> torch.Tensor:
        """[groups of sequence i, Hk, width]: a [Hk, blocks] mask for its one group, a [Hk, query blocks,
        blocks] one causal per query block (block b of the sequence sees blocks <= b)."""
        mask = mask.to(self.device)
        rows = mask[None] if mask.dim() == 2 else mask.tril(self.first_query_block[i]).transpose(0, 1)
        return rows if rows.shape[-1] == self.width else F.pad(rows, (0, self.width - rows.shape[-1]))


def group_plan_key(selection: Selection) -> tuple[int | None, ...]:
    """Selections with equal keys share a GroupPlan within a step."""
    return tuple(None if m is None else m.dim() for m in selection)


def group_metadata(backend: AttentionBackend, groups: QueryGroups, pool_ids: torch.Tensor, block_size: int,
                   device: torch.device, causal: bool = True, shared: dict | None = None) -> AttentionMetadata:
    """Per-KV-head metadata, one "sequence" per group, over the blocks each head attends that pool_ids
    [G, blocks] names in the pool at hand (-1: not in that pool). causal: dropped blocks are full and
    precede the group's queries, so compacting them away keeps the mask right; else the kept blocks are
    history. Built with tensor operations (no loop over blocks) and without a sync: the tables' width and
    the lengths' bounds come from the groups' ends, known on the host."""
    keep = groups.mask & (pool_ids >= 0)[:, None, :]
    kept = keep.sum(-1)  # [G, Hk]
    order = torch.sort(keep.to(torch.int8), dim=-1, descending=True, stable=True).indices  # kept first, in order
    visible = groups.visible_blocks(block_size)
    width = max(1, min(keep.shape[-1], max(visible, default=1)))
    tables = torch.where(keep, pool_ids[:, None, :], -1).gather(-1, order[..., :width])  # dropped ones: -1
    if causal:
        lengths, bounds = kept * block_size + groups.short_of_kept, groups.ends
    else:
        lengths, bounds = kept * block_size, [v * block_size for v in visible]
    return backend.build_head_metadata(groups.count, lengths, tables, block_size, device, max_seq_lens=bounds,
                                       shared=shared)
