"""The pinned host KV pool, the GPU ring of staging slots and the copy streams.

On the CPU ("device" and host pools both in RAM) the streams are absent and every copy is
synchronous, which is how the offload strategies are tested in CI.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from nanovllm.engine.kv_cache import PagedKVCache

RING_SLOTS = 2
RING_BASE = 1 << 40  # block-table entries >= RING_BASE name blocks of the kernel's second pool (ring or host)
RING_SLOT_BYTES = 256 * 2**20  # per slot; a 128-block slot of Llama-8B-shaped KV (1 MiB per block and layer)


def ring_blocks_for(bytes_per_block_and_layer: int) -> int:
    """Blocks per ring slot: RING_SLOT_BYTES of one layer's KV."""
    return max(1, RING_SLOT_BYTES // bytes_per_block_and_layer)


def consecutive_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src start, dst start, length) runs where both sides are consecutive."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


def run_indices(runs: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src start, dst start, n) runs -> (src, dst) block indices on device."""
    pairs = torch.tensor([(src + j, dst + j) for src, dst, n in runs for j in range(n)], dtype=torch.int64)
    pairs = pairs.view(-1, 2).to(device, non_blocking=True)
    return pairs[:, 0], pairs[:, 1]


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0


class HostKVPool:
    """The host pool [2, layers, host blocks, block_size, Hk, D] (pinned on CUDA), the ring
    [2, RING_SLOTS, ring_blocks, block_size, Hk, D] on the device, and the h2d / d2h copy streams.
    mirrored_layers: the first layers' host blocks also kept on the device ([2, mirrored_layers, host
    blocks, ...], `mirror`), for layers that always read every block (a sparse policy's dense layers)."""

    def __init__(self, kv_cache: PagedKVCache, num_host_blocks: int, ring_blocks: int, mirrored_layers: int = 0):
        data = kv_cache.data
        _, num_layers, _, block_size, num_kv_heads, head_dim = data.shape
        self.device = data.device
        self.device_cache = kv_cache
        self.num_layers = num_layers
        self.block_size = block_size
        self.ring_blocks = ring_blocks
        pin = self.device.type == "cuda"
        self.host = torch.empty(2, num_layers, num_host_blocks, block_size, num_kv_heads, head_dim, dtype=data.dtype,
                                pin_memory=pin)
        self.ring = torch.empty(2, RING_SLOTS, ring_blocks, block_size, num_kv_heads, head_dim, dtype=data.dtype,
                                device=self.device)
        self.mirror = torch.empty(2, min(mirrored_layers, num_layers), num_host_blocks, block_size, num_kv_heads,
                                  head_dim, dtype=data.dtype, device=self.device)
        self.h2d_stream = torch.cuda.Stream(self.device) if pin else None
        self.d2h_stream = torch.cuda.Stream(self.device) if pin else None
        self.last_d2h: torch.cuda.Event | None = None  # the previous step's last device->host copy
        self.stats = TransferStats()
        self.block_bytes_per_layer = self.host[:, 0, 0].numel() * self.host.element_size()

    @property
    def cuda(self) -> bool:
        return self.h2d_stream is not None

    @property
    def mirrored_layers(self) -> int:
        return self.mirror.shape[1]

    @property
    def num_host_blocks(self) -> int:
        return self.host.shape[2]

    def copy_out(self, layer: int, runs: list[tuple[int, int, int]]) -> None:
        """Copy one layer's (device start, host start, n) runs to the host pool (and the mirror) on the
        current stream."""
        for kv in range(2):  # views taken once: each run is then one slice and one copy
            source, host = self.device_cache.data[kv, layer], self.host[kv, layer]
            for device_start, host_start, n in runs:
                host[host_start : host_start + n].copy_(source[device_start : device_start + n], non_blocking=True)
            if layer < self.mirrored_layers:  # device to device: one gather for every run
                device_ids, host_ids = run_indices(runs, self.device)
                self.mirror[kv, layer].index_copy_(0, host_ids, source.index_select(0, device_ids))
        self.count("d2h", n=2 * len(runs), blocks=sum(r[2] for r in runs))

    def copy_out_now(self, offloads: list[tuple[int, int]]) -> None:
        """The step's (device block, host block) moves, every layer, on the current stream, after the
        copies an earlier step left on the d2h stream (for steps whose KV access copies nothing itself)."""
        if self.cuda and self.last_d2h is not None:
            torch.cuda.current_stream(self.device).wait_event(self.last_d2h)
        runs = consecutive_runs(sorted(offloads))
        for layer in range(self.num_layers if runs else 0):
            self.copy_out(layer, runs)

    def copy_in(self, layer: int, slot: int, runs: list[tuple[int, int, int]], values_only: bool = False) -> None:
        """Copy one layer's (host start, ring position, n) runs into a ring slot on the current stream
        (values_only: V alone, the caller has the keys)."""
        kinds = (1,) if values_only else (0, 1)
        for kv in kinds:
            ring, host = self.ring[kv, slot], self.host[kv, layer]
            for host_start, position, n in runs:
                ring[position : position + n].copy_(host[host_start : host_start + n], non_blocking=True)
        self.count("h2d", n=len(kinds) * len(runs), blocks=sum(r[2] for r in runs), share=len(kinds) / 2)

    def read_keys(self, layer: int, blocks: list[int], device: torch.device) -> torch.Tensor:
        """K (never V) of one layer's host blocks, on the device: [len(blocks), block_size, Hk, D]. Copied
        run by run on the h2d stream after this step's device->host copies (blocks moved out at the step's
        start are still being written to the host), and waited for by the current stream."""
        keys = torch.empty((len(blocks),) + tuple(self.host.shape[3:]), dtype=self.host.dtype, device=device)
        runs = consecutive_runs([(b, i) for i, b in enumerate(blocks)])
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            self.h2d_stream.wait_stream(current)
            if self.last_d2h is not None:
                self.h2d_stream.wait_event(self.last_d2h)
        with torch.cuda.stream(self.h2d_stream) if self.cuda else nullcontext():
            host = self.host[0, layer]
            for host_start, position, n in runs:
                keys[position : position + n].copy_(host[host_start : host_start + n], non_blocking=True)
        if self.cuda:
            current.wait_stream(self.h2d_stream)
            keys.record_stream(self.h2d_stream)
        self.stats.h2d_bytes += len(blocks) * self.block_bytes_per_layer // 2
        self.stats.h2d_copies += len(runs)
        return keys

    def count(self, direction: str, n: int, blocks: int, share: float = 1.0) -> None:
        """n copies of `blocks` blocks of one layer (share: the part of each block's K and V bytes moved)."""
        nbytes = int(blocks * self.block_bytes_per_layer * share)
        if direction == "h2d":
            self.stats.h2d_bytes += nbytes
            self.stats.h2d_copies += n
        else:
            self.stats.d2h_bytes += nbytes
            self.stats.d2h_copies += n
