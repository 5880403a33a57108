"""Offload decode steps whose host KV fits one ring slot, in a form a CUDA graph can capture.

The planner numbers the step's host blocks 0, 1, ... as positions of a ring slot and cuts their runs
into at most COPIES_PER_LAYER copies (`StepPlan.staged_copies`). Each layer's copies run on the copy
stream two layers ahead of the compute stream; the decode kernel reads the blocks from the slot where
the block table names them (entries >= RING_BASE). No merge: the step replays the ordinary decode
graphs. Inside a graph the copies are memcpy nodes whose addresses are set before each replay
(`graph_copies`), so they run on the copy engines, as fast as eager copies.
"""
from __future__ import annotations

import torch

from nanovllm.engine import graph_copies
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.offload.host_pool import RING_BASE, RING_SLOTS, HostKVPool
from nanovllm.kernels.reference import HostKV
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.kv_access import KVAccess

COPIES_PER_LAYER = 4  # copy nodes per layer and K/V in a decode graph: more runs of host blocks go the split way
MIN_COPY_BYTES = 2**20  # runs are not cut into copies shorter than this (small copies run far below PCIe speed)


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


def ring_tables(block_tables: list[list[int]], on_host: list[list[bool]] | None) -> list[list[int]]:
    """Block tables for the kernel: host blocks renamed RING_BASE + their ring position (in step order)."""
    if on_host is None:
        return block_tables
    position = iter(range(RING_BASE, RING_BASE + sum(map(sum, on_host))))
    return [[next(position) if h else b for b, h in zip(table, flags)] for table, flags in zip(block_tables, on_host)]


class StagedCopies:
    """The copies of the current step's host blocks into ring slots, layer by layer (engine-lifetime:
    decode graphs are captured with it). `set_step` takes the plan's copies; `StagedKV.attend` drives it."""

    def __init__(self, pool: HostKVPool):
        self.pool = pool
        self.pieces: list[tuple[int, int, int]] = []  # this step's (host block, ring position, n) copies
        self.copied: list[torch.cuda.Event | None] = [None] * pool.num_layers
        self.block_nbytes = pool.block_bytes_per_layer // 2  # K or V of one block in one layer
        self.placeholders: dict[tuple[int, int], tuple[int, int, int]] = {}  # (dst, src) -> (layer, kv, copy)

    @property
    def min_copy_blocks(self) -> int:
        return -(-MIN_COPY_BYTES // self.block_nbytes)

    def set_step(self, pieces: list[tuple[int, int, int]], offloads: list[tuple[int, int]]) -> None:
        """This step's copies. Blocks the step's scheduling moved out are copied to the host first, on
        the compute stream."""
        o = self.pool
        o.copy_out_now(offloads)
        self.pieces = pieces
        o.count("h2d", n=2 * len(pieces) * o.num_layers, blocks=sum(p[2] for p in pieces) * o.num_layers)

    def stage(self, layer: int) -> None:
        """Copy layer's host blocks into ring slot layer % RING_SLOTS (on the copy stream)."""
        slot, o = layer % RING_SLOTS, self.pool
        if not o.cuda:
            self._copy_pieces(layer, slot)
            return
        capturing = torch.cuda.is_current_stream_capturing()
        with torch.cuda.stream(o.h2d_stream):
            if capturing:
                self._capture_placeholders(layer, slot)
            else:
                self._copy_pieces(layer, slot)
            self.copied[layer] = torch.cuda.Event()
            self.copied[layer].record(o.h2d_stream)

    def _copy_pieces(self, layer: int, slot: int) -> None:
        for host_start, position, n in self.pieces:
            for kv in range(2):
                self.pool.ring[kv, slot, position : position + n].copy_(
                    self.pool.host[kv, layer, host_start : host_start + n], non_blocking=True)

    def _capture_placeholders(self, layer: int, slot: int) -> None:
        """COPIES_PER_LAYER memcpy nodes per K and V, each with its own (dst, src) so it can be found again."""
        for kv in range(2):
            for copy in range(COPIES_PER_LAYER):
                dst, src = self._ring_ptr(kv, slot, 0) + copy * 16, self._host_ptr(kv, layer, 0) + copy * 16
                self.placeholders[(dst, src)] = (layer, kv, copy)
                graph_copies.capture_copy(dst, src, 16)

    def _ring_ptr(self, kv: int, slot: int, position: int) -> int:
        return self.pool.ring[kv, slot].data_ptr() + position * self.block_nbytes

    def _host_ptr(self, kv: int, layer: int, block: int) -> int:
        return self.pool.host[kv, layer].data_ptr() + block * self.block_nbytes

    def copy_params(self) -> dict[tuple[int, int, int], tuple[int, int, int] | None]:
        """(layer, kv, copy) -> (dst, src, nbytes) of the step's pieces; None for copies beyond them."""
        params = {}
        for layer in range(self.pool.num_layers):
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


class StagedKV(KVAccess):
    """Decode attention over device blocks and the step's host blocks staged in ring slots, one kernel."""

    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata, copies: StagedCopies):
        self.cache, self.backend, self.meta, self.copies = cache, backend, meta, copies

    def attend(self, layer, q, k, v, scale):
        self.cache.write(layer, k, v, self.meta.slot_mapping)
        o = self.copies.pool
        compute = torch.cuda.current_stream(o.device) if o.cuda else None
        if layer == 0:
            if o.cuda:
                o.h2d_stream.wait_stream(compute)
            for first in range(min(RING_SLOTS, o.num_layers)):
                self.copies.stage(first)
        slot = layer % RING_SLOTS
        if o.cuda:
            compute.wait_event(self.copies.copied[layer])
        k_cache, v_cache = self.cache.layer(layer)
        out = self.backend.forward(q, k_cache, v_cache, self.meta, scale,
                                   host_kv=HostKV(o.ring[0, slot], o.ring[1, slot], RING_BASE))
        if layer + RING_SLOTS < o.num_layers:
            if o.cuda:
                o.h2d_stream.wait_stream(compute)  # the slot is free once this layer's attention ran
            self.copies.stage(layer + RING_SLOTS)
        return out

