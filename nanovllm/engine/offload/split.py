"""Offload steps outside the decode graphs: attention over device blocks plus host blocks streamed
through the GPU ring.

Placement (decided by the BlockManager): new KV is always written to device blocks; host blocks are
full and older than every new token. `SplitKV` splits each layer's attention in two and merges by
log-sum-exp: over the device blocks with the usual causal backend call on compacted tables (dropping
whole blocks that precede every query keeps the causal mask right), and over the host blocks without a
mask, in ring-slot pieces, each merged into the running float32 (out, LSE) inside the kernels. With a
dense selector every layer copies the same pieces, prefetched on the copy stream while the compute
stream attends over the other slot. With a narrower selection, each layer's copies are planned from
that layer's selection (the union over KV heads), so only selected host blocks cross PCIe. A mixed step
under a selector that selects pages in decode rows runs as two SplitKVs over its decode and its prefill
rows (`MixedRows`): the decode rows read their selected host pages in place, as in a decode step.

`SinglePassKV`: when the step's whole KV fits one ring slot, the device blocks are gathered into the
slot beside the host blocks and attention runs once over it with tables in position order: the very
arithmetic of device-only mode with the same schedule.

Blocks moved out by this step's scheduling are copied device->host on the d2h stream at the start of
the step, one layer at a time; each layer waits for its copy before storing new K/V, because the freed
device blocks may be reused in the same step.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.offload.host_pool import RING_BASE, RING_SLOTS, HostKVPool, consecutive_runs
from nanovllm.kernels.reference import HostKV, KeyCodes
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.block_selector import (BlockSelector, DecodeLayout, HostKeys, Selection, SelectionInput,
                                            SparseStats)
from nanovllm.layers.kv_access import (DeviceSelection, GroupPlan, KVAccess, MixedRows, QueryGroups,
                                      decode_metadata, group_metadata, group_plan_key, page_views, select_for_step)


@dataclass
class HistoryPiece:
    """Host blocks that fit in one ring slot: copy runs (host start, slot start, n) and the metadata of
    attention over them (seq_lens: each sequence's host tokens in this piece, tables into the slot)."""

    runs: list[tuple[int, int, int]]
    meta: AttentionMetadata


@dataclass
class SplitGroups:
    """A step's query groups for selections of one shape (`GroupPlan`) with what every layer reuses, on the
    device: per group, its sequence and its blocks' ids in the device pool (-1: on the host), in a second
    pool read in place (host blocks as RING_BASE + id), and which of them are host blocks."""

    plan: GroupPlan
    seq: torch.Tensor  # [G] int64
    device_ids: torch.Tensor  # [G, width]
    in_place_ids: torch.Tensor  # [G, width]
    on_host: torch.Tensor  # [G, width] bool
    # per-head metadata parts shared by the layers: over the device blocks (causal), over ring pieces (history)
    history_metadata: dict

    @classmethod
    def build(cls, batch: SelectionInput, selection: Selection, table_ids: list[torch.Tensor],
              host_flags: list[torch.Tensor]) -> SplitGroups:
        plan = GroupPlan(batch, selection)
        in_place_ids = plan.groups(selection).pool_ids(
            [torch.where(h, RING_BASE + t, t) for t, h in zip(table_ids, host_flags)])
        on_host = in_place_ids >= RING_BASE
        seq = torch.tensor(plan.seq, dtype=torch.int64).to(plan.device, non_blocking=True)
        return cls(plan, seq, torch.where(on_host, -1, in_place_ids), in_place_ids, on_host, {})

    def ring_ids(self, host_columns: list[list[tuple[int, int]]], ring_position: dict[int, int]) -> torch.Tensor:
        """[G, width] on the device: each group's blocks' positions in the ring (-1: not there), from host
        columns (per sequence, (column, host id) of its host blocks). Made per sequence, spread to the groups
        on the device (a host tensor of every group's row costs more)."""
        rows = [[-1] * self.plan.width for _ in host_columns]
        for row, columns in zip(rows, host_columns):
            for column, block in columns:
                row[column] = ring_position.get(block, -1)
        by_sequence = torch.tensor(rows, dtype=torch.int64).to(self.plan.device, non_blocking=True)
        return by_sequence.index_select(0, self.seq)


def pack(host_tables: list[list[int]], ring_blocks: int) -> list[tuple[list[tuple[int, int, int]], list[list[int]]]]:
    """Fill ring slots with each sequence's host blocks (runs of consecutive ids kept together):
    per piece, the copy runs and each sequence's table of ring positions."""
    pieces: list[tuple[list[tuple[int, int, int]], list[list[int]]]] = []
    runs: list[tuple[int, int, int]] = []
    tables: list[list[int]] = [[] for _ in host_tables]
    for i, blocks in enumerate(host_tables):
        for host_start, _, length in consecutive_runs([(b, b) for b in sorted(blocks)]):
            while length:
                used = sum(r[2] for r in runs)
                take = min(length, ring_blocks - used)
                runs.append((host_start, used, take))
                tables[i].extend(range(used, used + take))
                host_start, length = host_start + take, length - take
                if used + take == ring_blocks:
                    pieces.append((runs, tables))
                    runs, tables = [], [[] for _ in host_tables]
    if runs:
        pieces.append((runs, tables))
    return pieces


class _OffloadKV(KVAccess):
    """What both strategies share: the step's device->host copies, per layer, on the d2h stream."""

    def __init__(self, pool: HostKVPool, cache: PagedKVCache, backend: AttentionBackend,
                 offloads: list[tuple[int, int]]):
        self.pool, self.cache, self.backend = pool, cache, backend
        self.offload_runs = consecutive_runs(sorted(offloads))
        self.d2h_done: list[torch.cuda.Event] = []
        self.copied: dict[int, torch.cuda.Event] = {}
        self.slot_free: list[torch.cuda.Event | None] = [None] * RING_SLOTS

    def _compute_stream(self):
        return torch.cuda.current_stream(self.pool.device) if self.pool.cuda else None

    def begin(self) -> None:
        """Enqueue the device->host copies of every layer (and, in subclasses, the first ring fills)."""
        o = self.pool
        if o.cuda:
            o.h2d_stream.wait_stream(self._compute_stream())  # the previous step may still read the ring
            if o.last_d2h is not None:
                o.h2d_stream.wait_event(o.last_d2h)  # host blocks it wrote may be read now
        if not self.offload_runs:
            return
        if o.cuda:
            o.d2h_stream.wait_stream(self._compute_stream())
        for layer in range(o.num_layers):
            with torch.cuda.stream(o.d2h_stream) if o.cuda else nullcontext():
                o.copy_out(layer, self.offload_runs)
                if o.cuda:
                    event = torch.cuda.Event()
                    event.record(o.d2h_stream)
                    self.d2h_done.append(event)
        if o.cuda:
            o.last_d2h = self.d2h_done[-1]

    def _fill(self, layer: int, slot: int, runs: list[tuple[int, int, int]], key: int, values_only: bool = False) -> None:
        """Copy runs of layer's host blocks into a ring slot on the copy stream (event copied[key]);
        values_only: V alone (the caller brings the keys)."""
        o = self.pool
        with torch.cuda.stream(o.h2d_stream) if o.cuda else nullcontext():
            if o.cuda:
                if self.slot_free[slot] is not None:
                    o.h2d_stream.wait_event(self.slot_free[slot])
                if self.d2h_done:
                    o.h2d_stream.wait_event(self.d2h_done[layer])
            o.copy_in(layer, slot, runs, values_only)
            if o.cuda:
                event = torch.cuda.Event()
                event.record(o.h2d_stream)
                self.copied[key] = event

    def _wait_copied(self, key: int) -> None:
        if self.pool.cuda:
            self._compute_stream().wait_event(self.copied.pop(key))

    def _free_slot(self, slot: int) -> None:
        if self.pool.cuda:
            freed = torch.cuda.Event()
            freed.record(self._compute_stream())
            self.slot_free[slot] = freed

    def _store(self, layer: int, k, v, slots: torch.Tensor) -> None:
        if self.d2h_done:
            self._compute_stream().wait_event(self.d2h_done[layer])  # reused device blocks must be copied out first
        self.cache.write(layer, k, v, slots)


class SinglePassKV(_OffloadKV):
    """The step's whole KV in one ring slot, attended once (module docstring). Dense selection only."""

    def __init__(self, pool, cache, backend, offloads, block_tables: list[list[int]], on_host: list[list[bool]],
                 query_lens: list[int], seq_lens: list[int], slots: torch.Tensor):
        super().__init__(pool, cache, backend, offloads)
        bs = pool.block_size
        ring_tables, host_pairs, device_src, device_dst = [], [], [], []
        position = 0
        for table, flags in zip(block_tables, on_host):
            ring_tables.append(list(range(position, position + len(table))))
            for i, (block, host) in enumerate(zip(table, flags)):
                (host_pairs.append((block, position + i)) if host else
                 (device_src.append(block), device_dst.append(position + i)))
            position += len(table)
        as_index = lambda x: torch.tensor(x, dtype=torch.int64).to(pool.device, non_blocking=True)  # noqa: E731
        self.device_src, self.device_dst = as_index(device_src), as_index(device_dst)
        self.meta = backend.build_metadata(query_lens, seq_lens, ring_tables, [], bs, pool.device)
        self.host_runs = consecutive_runs(host_pairs)
        self.slots = slots  # the new tokens' device slots

    def begin(self) -> None:
        super().begin()
        for layer in range(min(RING_SLOTS, self.pool.num_layers)):
            self._fill(layer, layer % RING_SLOTS, self.host_runs, layer)

    def attend(self, layer, q, k, v, scale):
        self._store(layer, k, v, self.slots)  # the device cache keeps the new KV ...
        slot = layer % RING_SLOTS
        ring_k, ring_v = self.pool.ring[0, slot], self.pool.ring[1, slot]
        k_cache, v_cache = self.cache.layer(layer)
        if self.device_src.numel():  # ... and the ring gets every device block, the new KV included
            ring_k.index_copy_(0, self.device_dst, k_cache.index_select(0, self.device_src))
            ring_v.index_copy_(0, self.device_dst, v_cache.index_select(0, self.device_src))
        self._wait_copied(layer)
        out = self.backend.forward(q, ring_k, ring_v, self.meta, scale)
        self._free_slot(slot)
        if layer + RING_SLOTS < self.pool.num_layers:
            self._fill(layer + RING_SLOTS, slot, self.host_runs, layer + RING_SLOTS)
        return out


class SplitKV(_OffloadKV):
    """Device blocks, then host pieces through the ring, merged by LSE (module docstring)."""

    def __init__(self, pool, cache, backend, offloads, block_tables: list[list[int]], on_host: list[list[bool]],
                 query_lens: list[int], seq_lens: list[int], slots: list[int], selector: BlockSelector,
                 stats: SparseStats | None = None, prefill_ends: list[int] | None = None, part_of: SplitKV | None = None):
        """part_of: the mixed step this is a part of (MixedRows): its copy events are shared, nothing is
        prefetched (a layer reads the host blocks it selects, or all of them, when it attends)."""
        super().__init__(pool, cache, backend, offloads)
        bs = pool.block_size
        self.block_tables, self.on_host, self.selector, self.stats = block_tables, on_host, selector, stats
        # per sequence, (column, host id) of each of its host blocks
        self.host_columns = [[(c, b) for c, (b, h) in enumerate(zip(t, f)) if h] for t, f in zip(block_tables, on_host)]
        self.step_dense = part_of is None and (selector.dense or selector.dense_for_step(bs, query_lens, seq_lens))
        if part_of is not None:
            self.d2h_done, self.copied, self.slot_free = part_of.d2h_done, part_of.copied, part_of.slot_free
        self.batch = SelectionInput(query_lens, seq_lens, bs, block_tables, on_host, stats, host_keys=HostKeys(),
                                    prefill_ends=prefill_ends,
                                    **({} if self.step_dense else self._selector_tables(pool.device)))
        device_tables = [[b for b, h in zip(t, f) if not h] for t, f in zip(block_tables, on_host)]
        compact_lens = [n - sum(f) * bs for n, f in zip(seq_lens, on_host)]
        self.meta = backend.build_metadata(query_lens, compact_lens, device_tables, slots, bs, pool.device)
        self.host_tables = [[b for b, h in zip(t, f) if h] for t, f in zip(block_tables, on_host)]
        # A selector dense for this step reads the same pieces in every layer: planned once, prefetched on the
        # copy stream (a sparse policy's mirrored layers read the mirror instead).
        self.first_copied = 0 if selector.dense else pool.mirrored_layers
        self.pieces = self._pieces(self.host_tables) if self.step_dense else []
        self.all_pieces: list[HistoryPiece] | None = None  # the same, not prefetched, for layers a sparse step reads whole
        self.host_meta: AttentionMetadata | None = None
        self.layout: DecodeLayout | None = None
        # per sequence, its blocks as ids within their pool and where they live (the same in every layer)
        self.table_ids = [torch.tensor(t, dtype=torch.int64) for t in block_tables]
        self.host_flags = [torch.tensor(f, dtype=torch.bool) for f in on_host]
        self.split_groups: dict[tuple[int | None, ...], SplitGroups] = {}  # the same for every layer of the step
        self.mixed = MixedRows(query_lens, pool.device, self._part) \
            if not self.step_dense and MixedRows.wanted(selector, query_lens, bs) else None

    def _part(self, seqs: list[int]) -> SplitKV:
        """The step's sequences seqs as a step of their own (their K/V stored by this one), counted in stats."""
        pick = lambda values: [values[i] for i in seqs]  # noqa: E731
        return SplitKV(self.pool, self.cache, self.backend, [], pick(self.block_tables), pick(self.on_host),
                       pick(self.batch.query_lens), pick(self.batch.seq_lens), [], self.selector,
                       None if self.stats is None else self.stats.part(seqs),
                       None if self.batch.prefill_ends is None else pick(self.batch.prefill_ends), part_of=self)

    def _selector_tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """SelectionInput's device_tables (host blocks as 0) and host_columns, on the device once per step:
        what a selector reads the step's keys through in every layer."""
        width = max(map(len, self.block_tables))
        device_ids = [[0 if h else b for b, h in zip(t, f)] + [-1] * (width - len(t))
                      for t, f in zip(self.block_tables, self.on_host)]
        widest = max(map(len, self.host_columns))
        host_columns = [[c for c, _ in columns] + [-1] * (widest - len(columns)) for columns in self.host_columns]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)  # noqa: E731
        return {"device_tables": as_tensor(device_ids), "host_columns": as_tensor(host_columns)}

    def _pieces(self, host_tables: list[list[int]]) -> list[HistoryPiece]:
        bs, q_lens = self.pool.block_size, self.batch.query_lens
        return [HistoryPiece(runs, self.backend.build_metadata(q_lens, [len(t) * bs for t in tables], tables, [], bs,
                                                               self.pool.device))
                for runs, tables in pack(host_tables, self.pool.ring_blocks)]

    @property
    def num_units(self) -> int:
        return (self.pool.num_layers - self.first_copied) * len(self.pieces)

    def begin(self) -> None:
        super().begin()
        for unit in range(min(RING_SLOTS, self.num_units)):
            self._fill_unit(unit)

    def _fill_unit(self, unit: int) -> None:
        """(layer - first_copied, piece) = divmod(unit, pieces) into ring slot unit % RING_SLOTS."""
        layer, p = divmod(unit, len(self.pieces))
        self._fill(self.first_copied + layer, unit % RING_SLOTS, self.pieces[p].runs, unit)

    def attend(self, layer, q, k, v, scale):
        self._store(layer, k, v, self.meta.slot_mapping)
        return self.attend_stored(layer, q, scale)

    def attend_stored(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """attend() once the layer's new K/V are stored (and the layer's device->host copies waited for)."""
        if self.mixed is not None:
            return self.mixed.attend(layer, q, scale)
        k_cache, v_cache = self.cache.layer(layer)
        head_bytes = self.pool.block_bytes_per_layer // k_cache.shape[2]
        self.batch.host_keys.clear()  # the keys a selector reads are this layer's
        codes = self.selector.host_key_codes(layer)  # keys of host pages read in place: from the codes
        if self.step_dense:
            selection = None
            if self.stats is not None:
                self.stats.add(self.batch, None, k_cache.shape[2])
        else:
            read = head_bytes if codes is None else head_bytes // 2
            selection = select_for_step(self.selector, layer, q, k_cache.shape[2], self.batch, self._layout,
                                        head_bytes, read)
        if isinstance(selection, DeviceSelection):  # decode: host blocks read in place, counted on the device
            k_pages, v_pages, host = page_views(selection.layout.block_size, k_cache, v_cache,
                                                self._host_kv(layer, codes))
            return self.backend.forward(q, k_pages, v_pages, decode_metadata(self.backend, selection), scale,
                                        host_kv=host)
        if selection is not None:
            return self._attend_selected(layer, q, k_cache, v_cache, selection, scale)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        self.backend.forward_with_lse(q, k_cache, v_cache, self.meta, scale, out=(out, lse))
        if not self.selector.dense and layer < self.pool.mirrored_layers:  # its host blocks are on the device too
            if not any(self.host_tables):
                return out.to(q.dtype)
            self.backend.history_attention(q, self.pool.mirror[0, layer], self.pool.mirror[1, layer],
                                           self._host_meta(), scale, (out, lse))
            return out.to(q.dtype)
        if not self.step_dense:  # this layer reads every host block, copied now (nothing was prefetched)
            return self._attend_all_now(layer, q, scale, out, lse)
        self._count_all_host_blocks()
        for p, piece in enumerate(self.pieces):
            unit = (layer - self.first_copied) * len(self.pieces) + p
            slot = unit % RING_SLOTS
            self._wait_copied(unit)
            # merged into (out, lse) by log-sum-exp inside the kernels: no separate merge pass
            self.backend.history_attention(q, self.pool.ring[0, slot], self.pool.ring[1, slot], piece.meta, scale,
                                           (out, lse))
            self._free_slot(slot)
            if unit + RING_SLOTS < self.num_units:
                self._fill_unit(unit + RING_SLOTS)
        return out.to(q.dtype)

    def _host_kv(self, layer: int, key_codes: KeyCodes | None = None) -> HostKV:
        """This layer's host pool as the decode kernel's second pool, read in place (entries >= RING_BASE)."""
        return HostKV(self.pool.host[0, layer], self.pool.host[1, layer], RING_BASE, key_codes)

    def _layout(self, batch: SelectionInput) -> DecodeLayout:
        if self.layout is None:
            self.layout = DecodeLayout.build(batch, self.pool.device, second_pool_base=RING_BASE)
        return self.layout

    def _host_meta(self) -> AttentionMetadata:
        """Attention over every host block, tables of host ids (for the mirrored layers)."""
        if self.host_meta is None:
            bs = self.pool.block_size
            self.host_meta = self.backend.build_metadata(self.batch.query_lens, [len(t) * bs for t in self.host_tables],
                                                         self.host_tables, [], bs, self.pool.device)
        return self.host_meta

    def _count_all_host_blocks(self) -> None:
        if self.stats is not None:
            for i, blocks in enumerate(self.host_tables):
                self.stats.host_bytes[i] += len(blocks) * self.pool.block_bytes_per_layer

    def _attend_all_now(self, layer: int, q, scale, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Every host block of this layer, piece by piece through ring slot 0, merged into (out, lse)."""
        self._count_all_host_blocks()
        if self.all_pieces is None:
            self.all_pieces = self._pieces(self.host_tables)
        for piece in self.all_pieces:
            self._fill(layer, 0, piece.runs, -1)
            self._wait_copied(-1)
            self.backend.history_attention(q, self.pool.ring[0, 0], self.pool.ring[1, 0], piece.meta, scale, (out, lse))
            self._free_slot(0)
        return out.to(q.dtype)

    def _split_groups(self, selection: Selection) -> SplitGroups:
        key = group_plan_key(selection)
        if key not in self.split_groups:
            self.split_groups[key] = SplitGroups.build(self.batch, selection, self.table_ids, self.host_flags)
        return self.split_groups[key]

    def _attend_selected(self, layer: int, q, k_cache, v_cache, selection, scale) -> torch.Tensor:
        """Per KV head over its selected blocks. Decode rows read their selected host blocks in place;
        otherwise this layer copies the union of the heads' host blocks through the ring: only their V
        where the selector already brought their K to the device for its estimate."""
        step = self._split_groups(selection)
        groups = step.plan.groups(selection)
        if max(self.batch.query_lens) == 1:
            return self._attend_in_place(layer, q, k_cache, v_cache, groups, step, scale)
        bs, wanted = self.pool.block_size, self._wanted_host_blocks(groups, step)
        keys = self.batch.host_keys
        values_only = all(b in keys for blocks in wanted for b in blocks)
        if self.stats is not None:
            for i, blocks in enumerate(wanted):
                self.stats.host_bytes[i] += len(blocks) * self.pool.block_bytes_per_layer // (2 if values_only else 1)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        meta = group_metadata(self.backend, groups, step.device_ids, bs, q.device, shared=step.plan.shared_metadata)
        self.backend.forward_with_lse(q, k_cache, v_cache, meta, scale, out=(out, lse))
        for runs, _ in pack(wanted, self.pool.ring_blocks):
            self._fill(layer, 0, runs, -1, values_only=values_only)
            self._wait_copied(-1)
            ring_position = {h + j: p + j for h, p, n in runs for j in range(n)}
            if values_only:
                positions = torch.tensor(list(ring_position.values()), dtype=torch.int64)
                self.pool.ring[0, 0].index_copy_(0, positions.to(q.device, non_blocking=True),
                                                 keys.gather(list(ring_position)))
            meta = group_metadata(self.backend, groups, step.ring_ids(self.host_columns, ring_position), bs, q.device,
                                  causal=False, shared=step.history_metadata)
            self.backend.history_attention(q, self.pool.ring[0, 0], self.pool.ring[1, 0], meta, scale, (out, lse))
            self._free_slot(0)
        return out.to(q.dtype)

    def _wanted_host_blocks(self, groups: QueryGroups, step: SplitGroups) -> list[list[int]]:
        """Per sequence, the host blocks some head of some group attends: one read of a [sequences, width]
        mask (the copies are planned on the host)."""
        attended = (groups.mask.any(1) & step.on_host).to(torch.int32)
        by_sequence = torch.zeros((len(self.host_columns), attended.shape[1]), dtype=torch.int32,
                                  device=attended.device).index_add_(0, step.seq, attended)
        rows = by_sequence.cpu().tolist()
        return [[b for c, b in columns if rows[i][c]] for i, columns in enumerate(self.host_columns)]

    def _attend_in_place(self, layer: int, q, k_cache, v_cache, groups: QueryGroups, step: SplitGroups,
                         scale) -> torch.Tensor:
        """Decode rows: one kernel over each head's selected blocks, host ones read from pinned memory."""
        codes = self.selector.host_key_codes(layer)
        head_bytes = self.pool.block_bytes_per_layer // k_cache.shape[2] // (1 if codes is None else 2)
        host_blocks = (groups.mask & step.on_host[:, None, :]).sum((1, 2)).tolist()  # per group
        self.pool.stats.h2d_bytes += sum(host_blocks) * head_bytes
        if self.stats is not None:
            for seq, n in zip(groups.seq, host_blocks):
                self.stats.host_bytes[seq] += n * head_bytes
        meta = group_metadata(self.backend, groups, step.in_place_ids, self.pool.block_size, q.device,
                              shared=step.plan.shared_metadata)
        return self.backend.forward(q, k_cache, v_cache, meta, scale, host_kv=self._host_kv(layer, codes))
