"""KV-cache CPU offload: a pinned host pool and, per step, the copies and attention it needs.

Placement (decided by the BlockManager): new KV is always written to device blocks; full, computed
blocks move to the host pool when the device pool runs short. A step therefore sees, per sequence,
some device blocks (its newest tokens always among them) and some host blocks, all full and all older
than the step's new tokens. Attention of one layer is split in two and merged by log-sum-exp:

- over the device blocks, with the usual causal backend call (which also stores the new K/V), on a
  compacted block table: dropping whole blocks that precede every query keeps the causal mask right;
- over the host blocks, without a mask, streamed through a GPU ring of RING_SLOTS staging slots on a
  copy stream: while the compute stream attends over one slot, the next (layer, piece) is copied into
  the other. Host KV that exceeds a slot is split into several pieces.

Blocks moved out by this step's scheduling are copied device->host on a second stream at the start of
the step, one layer at a time; each layer waits for its copy before storing new K/V, because the freed
device blocks may be reused in the same step. On the CPU ("device" and host pools both in RAM) the
streams are absent and every copy is synchronous, which is how the orchestration is tested in CI.

Decode steps whose host blocks fit one ring slot take another path (`StagedDecode`) that a CUDA graph
can capture: each layer's host blocks are copied into a ring slot on the copy stream, two layers ahead
of the compute stream, and the decode kernel reads them from the slot where the block table names
them (entries >= HOST_BASE). No merge: the step replays the ordinary decode graphs. Inside a graph the
copies are memcpy nodes (at most COPIES_PER_LAYER per layer and K/V) whose addresses are set before
each replay (`graph_copies`), so they run on the copy engines, as fast as eager copies.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from nanovllm.engine import graph_copies
from nanovllm.engine.block_manager import HOST_BASE
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.kernels.reference import HostKV
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata, store_kv

RING_SLOTS = 2
RING_SLOT_BYTES = 256 * 2**20  # per slot; a 128-block slot of Llama-8B-shaped KV (1 MiB per block and layer)
COPIES_PER_LAYER = 4  # copy nodes per layer and K/V in a decode graph: more runs of host blocks go eager
MIN_COPY_BYTES = 2**20  # runs are not cut into copies shorter than this (small copies run far below PCIe speed)


def consecutive_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src start, dst start, length) runs where both sides are consecutive."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


@dataclass
class HistoryPiece:
    """Host blocks that fit in one ring slot: copy runs (host start, slot start, n) and the metadata of
    attention over them (seq_lens: each sequence's host tokens in this piece, tables into the slot)."""

    runs: list[tuple[int, int, int]]
    meta: AttentionMetadata


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0


@dataclass
class SinglePass:
    """When the step's whole KV (device and host blocks) fits in one ring slot: per layer, the device
    blocks are gathered into the slot beside the host blocks, and the backend's ordinary attention runs
    once over the slot with tables in position order, so the arithmetic is exactly that of device-only
    mode with the same schedule (no split, no merge)."""

    device_src: torch.Tensor  # int64 device block ids ...
    device_dst: torch.Tensor  # ... and their ring positions
    meta: AttentionMetadata  # over the ring slot: real seq_lens, tables into the slot, ring slots of new tokens


class KVOffloader:
    """The pinned host pool [2, layers, host blocks, block_size, Hk, D], the GPU ring and the copy streams."""

    def __init__(self, kv_cache: PagedKVCache, num_host_blocks: int, ring_blocks: int):
        data = kv_cache.data
        _, num_layers, _, block_size, num_kv_heads, head_dim = data.shape
        self.device = data.device
        self.device_kv = data
        self.num_layers = num_layers
        self.block_size = block_size
        self.ring_blocks = ring_blocks
        pin = self.device.type == "cuda"
        self.host = torch.empty(2, num_layers, num_host_blocks, block_size, num_kv_heads, head_dim, dtype=data.dtype,
                                pin_memory=pin)
        self.ring = torch.empty(2, RING_SLOTS, ring_blocks, block_size, num_kv_heads, head_dim, dtype=data.dtype,
                                device=self.device)
        self.h2d_stream = torch.cuda.Stream(self.device) if pin else None
        self.d2h_stream = torch.cuda.Stream(self.device) if pin else None
        self.last_d2h: torch.cuda.Event | None = None  # the previous step's last device->host copy
        self.stats = TransferStats()
        self.staged_max_blocks = ring_blocks
        self.staged = StagedDecode(self)
        # False: every decode step over host KV takes the eager split path (a peer; also where the CUDA
        # runtime's graph-update calls cannot be reached, since the decode graphs need them)
        self.staged_decode = not pin or graph_copies.available()

    def copy_out(self, layer: int, runs: list[tuple[int, int, int]]) -> None:
        """Copy one layer's (device start, host start, n) runs to the host pool on the current stream."""
        for device_start, host_start, n in runs:
            for kv in range(2):
                self.host[kv, layer, host_start : host_start + n].copy_(
                    self.device_kv[kv, layer, device_start : device_start + n], non_blocking=True)
        self.count("d2h", n=2 * len(runs), blocks=sum(r[2] for r in runs))

    def count(self, direction: str, n: int, blocks: int) -> None:
        nbytes = blocks * self.block_bytes_per_layer
        if direction == "h2d":
            self.stats.h2d_bytes += nbytes
            self.stats.h2d_copies += n
        else:
            self.stats.d2h_bytes += nbytes
            self.stats.d2h_copies += n

    @property
    def block_bytes_per_layer(self) -> int:
        return self.host[:, 0, 0].numel() * self.host.element_size()

    def plan_step(self, backend: AttentionBackend, query_lens: list[int], seq_lens: list[int],
                  tables: list[list[tuple[bool, int]]], offloads: list[tuple[int, int]]) -> OffloadStep:
        """tables: per sequence, its blocks in position order as (on host, id); offloads: (device, host)
        blocks to copy out before any KV write."""
        offload_runs = consecutive_runs(sorted(offloads))
        if sum(map(len, tables)) <= self.ring_blocks:
            return self._plan_single_pass(backend, query_lens, seq_lens, tables, offload_runs)
        host_tables = [[b for on_host, b in t if on_host] for t in tables]
        pieces = [HistoryPiece(runs, backend.build_metadata(query_lens, [len(t) * self.block_size for t in piece],
                                                            piece, [], self.block_size, self.device))
                  for runs, piece in self._pack(host_tables)]
        return OffloadStep(self, pieces, offload_runs)

    def _plan_single_pass(self, backend: AttentionBackend, query_lens: list[int], seq_lens: list[int],
                          tables: list[list[tuple[bool, int]]], offload_runs: list[tuple[int, int, int]]) -> OffloadStep:
        bs = self.block_size
        ring_tables, host_pairs, device_src, device_dst, slots = [], [], [], [], []
        position = 0
        for table, n, seq_len in zip(tables, query_lens, seq_lens):
            ring_tables.append(list(range(position, position + len(table))))
            for i, (on_host, block) in enumerate(table):
                (host_pairs.append((block, position + i)) if on_host else
                 (device_src.append(block), device_dst.append(position + i)))
            slots.extend(ring_tables[-1][p // bs] * bs + p % bs for p in range(seq_len - n, seq_len))
            position += len(table)
        as_index = lambda x: torch.tensor(x, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        meta = backend.build_metadata(query_lens, seq_lens, ring_tables, slots, bs, self.device)
        single = SinglePass(as_index(device_src), as_index(device_dst), meta)
        return OffloadStep(self, [HistoryPiece(consecutive_runs(host_pairs), meta)], offload_runs, single)

    def _pack(self, host_tables: list[list[int]]) -> list[tuple[list[tuple[int, int, int]], list[list[int]]]]:
        """Fill ring slots with each sequence's host blocks (runs of consecutive ids kept together)."""
        pieces: list[tuple[list[tuple[int, int, int]], list[list[int]]]] = []
        runs: list[tuple[int, int, int]] = []
        tables: list[list[int]] = [[] for _ in host_tables]
        for i, blocks in enumerate(host_tables):
            for host_start, _, length in consecutive_runs([(b, b) for b in sorted(blocks)]):
                while length:
                    used = sum(r[2] for r in runs)
                    take = min(length, self.ring_blocks - used)
                    runs.append((host_start, used, take))
                    tables[i].extend(range(used, used + take))
                    host_start, length = host_start + take, length - take
                    if used + take == self.ring_blocks:
                        pieces.append((runs, tables))
                        runs, tables = [], [[] for _ in host_tables]
        if runs:
            pieces.append((runs, tables))
        return pieces


class OffloadStep:
    """One step's copies and split attention; `attention` is called by every layer, in order."""

    def __init__(self, offloader: KVOffloader, pieces: list[HistoryPiece], offload_runs: list[tuple[int, int, int]],
                 single: SinglePass | None = None):
        self.o = offloader
        self.pieces = pieces
        self.single = single
        self.offload_runs = offload_runs
        self.cuda = offloader.h2d_stream is not None
        self.d2h_done: list[torch.cuda.Event] = []
        self.copied: dict[int, torch.cuda.Event] = {}
        self.slot_free: list[torch.cuda.Event | None] = [None] * RING_SLOTS

    @property
    def num_units(self) -> int:
        return self.o.num_layers * len(self.pieces)

    def begin(self) -> None:
        """Enqueue the device->host copies of every layer and the first ring fills."""
        if self.cuda:
            compute = torch.cuda.current_stream(self.o.device)
            self.o.h2d_stream.wait_stream(compute)  # the previous step may still read the ring
            if self.o.last_d2h is not None:
                self.o.h2d_stream.wait_event(self.o.last_d2h)  # host blocks it wrote may be read now
        self._offload_all_layers()
        for unit in range(min(RING_SLOTS, self.num_units)):
            self._fill(unit)

    def _offload_all_layers(self) -> None:
        if not self.offload_runs:
            return
        if self.cuda:
            self.o.d2h_stream.wait_stream(torch.cuda.current_stream(self.o.device))
        for layer in range(self.o.num_layers):
            with torch.cuda.stream(self.o.d2h_stream) if self.cuda else nullcontext():
                self.o.copy_out(layer, self.offload_runs)
                if self.cuda:
                    event = torch.cuda.Event()
                    event.record(self.o.d2h_stream)
                    self.d2h_done.append(event)
        if self.cuda:
            self.o.last_d2h = self.d2h_done[-1]

    def _fill(self, unit: int) -> None:
        """Copy (layer, piece) = divmod(unit, pieces) into ring slot unit % RING_SLOTS."""
        layer, p = divmod(unit, len(self.pieces))
        slot = unit % RING_SLOTS
        runs = self.pieces[p].runs
        with torch.cuda.stream(self.o.h2d_stream) if self.cuda else nullcontext():
            if self.cuda:
                if self.slot_free[slot] is not None:
                    self.o.h2d_stream.wait_event(self.slot_free[slot])
                if self.d2h_done:
                    self.o.h2d_stream.wait_event(self.d2h_done[layer])
            for host_start, ring_start, n in runs:
                for kv in range(2):
                    self.o.ring[kv, slot, ring_start : ring_start + n].copy_(
                        self.o.host[kv, layer, host_start : host_start + n], non_blocking=True)
            self.o.count("h2d", n=2 * len(runs), blocks=sum(r[2] for r in runs))
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.o.h2d_stream)
                self.copied[unit] = event

    def attention(self, layer: int, backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store the new K/V, attend over device blocks, then over each host piece, each merged by LSE."""
        compute = torch.cuda.current_stream(self.o.device) if self.cuda else None
        if self.d2h_done:
            compute.wait_event(self.d2h_done[layer])  # reused device blocks must be copied out first
        if self.single is not None:
            return self._single_pass(layer, backend, q, k, v, k_cache, v_cache, meta, scale, compute)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        backend.forward_with_lse(q, k, v, k_cache, v_cache, meta, scale, out=(out, lse))
        for p, piece in enumerate(self.pieces):
            unit = layer * len(self.pieces) + p
            slot = unit % RING_SLOTS
            if self.cuda:
                compute.wait_event(self.copied.pop(unit))
            # merged into (out, lse) by log-sum-exp inside the kernels: no separate merge pass
            backend.history_attention(q, self.o.ring[0, slot], self.o.ring[1, slot], piece.meta, scale, (out, lse))
            self._release(unit, compute)
        return out.to(q.dtype)

    def _single_pass(self, layer: int, backend: AttentionBackend, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
                     scale: float, compute) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # the device cache keeps the new KV
        slot = layer % RING_SLOTS
        ring_k, ring_v = self.o.ring[0, slot], self.o.ring[1, slot]
        if self.single.device_src.numel():
            ring_k.index_copy_(0, self.single.device_dst, k_cache.index_select(0, self.single.device_src))
            ring_v.index_copy_(0, self.single.device_dst, v_cache.index_select(0, self.single.device_src))
        if self.cuda:
            compute.wait_event(self.copied.pop(layer))
        out = backend.forward(q, k, v, ring_k, ring_v, self.single.meta, scale)  # stores k, v again, in the ring
        self._release(layer, compute)
        return out

    def _release(self, unit: int, compute) -> None:
        """The compute stream is done with unit's ring slot once its queued work so far has run:
        refill the slot with the unit RING_SLOTS ahead."""
        if self.cuda:
            freed = torch.cuda.Event()
            freed.record(compute)
            self.slot_free[unit % RING_SLOTS] = freed
        if unit + RING_SLOTS < self.num_units:
            self._fill(unit + RING_SLOTS)


def split_runs(runs: list[tuple[int, int, int]], copies: int, min_blocks: int = 1) -> list[tuple[int, int, int]] | None:
    """(src, dst, n) runs cut into at most `copies` pieces, the longest halved until there are `copies`
    (more, shorter copies keep the copy engines busy from the first block) or halves would be shorter
    than min_blocks; None if there are more runs than copies."""
    if len(runs) > copies:
        return None
    pieces = list(runs)
    while len(pieces) < copies:
        i = max(range(len(pieces)), key=lambda j: pieces[j][2], default=None)
        if i is None or pieces[i][2] < 2 * max(1, min_blocks):
            break
        src, dst, n = pieces[i]
        half = n // 2
        pieces[i : i + 1] = [(src, dst, half), (src + half, dst + half, n - half)]
    return pieces


class StagedDecode:
    """Decode steps with at most staged_max_blocks host blocks, in at most COPIES_PER_LAYER runs (module
    docstring). `prepare` numbers the step's host blocks as ring positions and plans the copies; `attention`
    (called by every layer, in order) enqueues layer L + 2's copies on the copy stream and waits for layer
    L's. Captured in a decode graph, each copy is a memcpy node (`graph_copies`): `update_graph` gives the
    nodes the step's addresses before the replay, so the copies run on the copy engines at DMA speed."""

    def __init__(self, offloader: KVOffloader):
        self.o = offloader
        self.cuda = offloader.h2d_stream is not None
        self.pieces: list[tuple[int, int, int]] = []  # this step's (host block, ring position, n) copies
        self.copied: list[torch.cuda.Event | None] = [None] * offloader.num_layers
        self.block_nbytes = offloader.block_bytes_per_layer // 2  # K or V of one block in one layer
        self.placeholders: dict[tuple[int, int], tuple[int, int, int]] = {}  # (dst, src) -> (layer, kv, copy)

    def prepare(self, tables: list[list[int]], offloads: list[tuple[int, int]]) -> list[list[int]] | None:
        """Number the step's host blocks 0, 1, ... (their slot positions) and return the tables with those
        entries renamed HOST_BASE + position; None when there are more than staged_max_blocks, or more runs of
        consecutive blocks than copies. Blocks the step's scheduling moved out are copied to the host first,
        on the compute stream."""
        host_ids = [b - HOST_BASE for t in tables for b in t if b >= HOST_BASE]
        if len(host_ids) > self.o.staged_max_blocks:
            return None
        pieces = split_runs(consecutive_runs(list(zip(host_ids, range(len(host_ids))))), COPIES_PER_LAYER,
                            -(-MIN_COPY_BYTES // self.block_nbytes))
        if pieces is None:
            return None
        if self.o.last_d2h is not None:  # host blocks an earlier step copied out on the side stream
            torch.cuda.current_stream(self.o.device).wait_event(self.o.last_d2h)
        runs = consecutive_runs(sorted(offloads))
        for layer in range(self.o.num_layers if runs else 0):
            self.o.copy_out(layer, runs)
        self.pieces = pieces
        self.o.count("h2d", n=2 * len(pieces) * self.o.num_layers, blocks=len(host_ids) * self.o.num_layers)
        position = iter(range(HOST_BASE, HOST_BASE + len(host_ids)))
        return [[next(position) if b >= HOST_BASE else b for b in t] for t in tables]

    def begin(self) -> None:
        """Nothing to enqueue before the forward: `prepare` did the step's host-side work."""

    def attention(self, layer: int, backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.o.device) if self.cuda else None
        if layer == 0:
            if self.cuda:
                self.o.h2d_stream.wait_stream(compute)
            for first in range(min(RING_SLOTS, self.o.num_layers)):
                self._stage(first)
        slot = layer % RING_SLOTS
        if self.cuda:
            compute.wait_event(self.copied[layer])
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale,
                              host_kv=HostKV(self.o.ring[0, slot], self.o.ring[1, slot], HOST_BASE))
        if layer + RING_SLOTS < self.o.num_layers:
            if self.cuda:
                self.o.h2d_stream.wait_stream(compute)  # the slot is free once this layer's attention ran
            self._stage(layer + RING_SLOTS)
        return out

    def _stage(self, layer: int) -> None:
        """Copy layer's host blocks into ring slot layer % RING_SLOTS (on the copy stream)."""
        slot = layer % RING_SLOTS
        if not self.cuda:
            self._copy_pieces(layer, slot)
            return
        capturing = torch.cuda.is_current_stream_capturing()
        with torch.cuda.stream(self.o.h2d_stream):
            if capturing:
                self._capture_placeholders(layer, slot)
            else:
                self._copy_pieces(layer, slot)
            self.copied[layer] = torch.cuda.Event()
            self.copied[layer].record(self.o.h2d_stream)

    def _copy_pieces(self, layer: int, slot: int) -> None:
        for host_start, position, n in self.pieces:
            for kv in range(2):
                self.o.ring[kv, slot, position : position + n].copy_(
                    self.o.host[kv, layer, host_start : host_start + n], non_blocking=True)

    def _capture_placeholders(self, layer: int, slot: int) -> None:
        """COPIES_PER_LAYER memcpy nodes per K and V, each with its own (dst, src) so it can be found again."""
        for kv in range(2):
            for copy in range(COPIES_PER_LAYER):
                dst, src = self._ring_ptr(kv, slot, 0) + copy * 16, self._host_ptr(kv, layer, 0) + copy * 16
                self.placeholders[(dst, src)] = (layer, kv, copy)
                graph_copies.capture_copy(dst, src, 16)

    def _ring_ptr(self, kv: int, slot: int, position: int) -> int:
        return self.o.ring[kv, slot].data_ptr() + position * self.block_nbytes

    def _host_ptr(self, kv: int, layer: int, block: int) -> int:
        return self.o.host[kv, layer].data_ptr() + block * self.block_nbytes

    def copy_params(self) -> dict[tuple[int, int, int], tuple[int, int, int] | None]:
        """(layer, kv, copy) -> (dst, src, nbytes) of the step's pieces; None for copies beyond them."""
        params = {}
        for layer in range(self.o.num_layers):
            slot = layer % RING_SLOTS
            for kv in range(2):
                for copy in range(COPIES_PER_LAYER):
                    if copy < len(self.pieces):
                        host_start, position, n = self.pieces[copy]
                        params[(layer, kv, copy)] = (self._ring_ptr(kv, slot, position),
                                                     self._host_ptr(kv, layer, host_start), n * self.block_nbytes)
                    else:
                        params[(layer, kv, copy)] = None
        return params

    def update_graph(self, copies) -> None:
        """Before replaying a graph captured with this handler: its copy nodes get this step's pieces."""
        version = tuple(self.pieces)
        if copies.version != version:
            copies.set(self.copy_params(), version)
