"""Per-block metadata that sparse policies keep through the KV-write hook (engine/kv_cache.py).

`BlockKeyBounds` keeps, per layer, page (`page_size` consecutive tokens of a block) and KV head, the
elementwise min and max of the keys written into the page so far (post-RoPE): what Quest's upper bound
on a page's attention scores needs. It lives on the cache's device for every block, device- and
host-resident alike: a write updates the device block's pages, a move to the host copies them to the
host block's rows. Stored in the cache's dtype (min and max of stored keys are exact in it): 1/page_size
of the key bytes for each of min and max.

Two ways to keep them: the write hook (`on_write`, every write of every layer updates its pages) or,
given the device pool's keys (`keys`), lazily (`fill`): a block's bounds are computed from its keys, once,
when a selection first needs them (only ever for full blocks: Quest always keeps a sequence's most recent
block), or when it moves to the host. The engine fills lazily: sequences that never select (below
sparse_min_context) then cost nothing, where the hook ran ~12 kernels in every layer of every step.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

# PyTorch warns on every first use that index_reduce_ is in beta; its amin/amax are what the bounds need.
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")


class BlockKeyBounds:
    def __init__(self, num_layers: int, num_blocks: int, num_host_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, page_size: int | None = None, dtype: torch.dtype = torch.float32,
                 keys: torch.Tensor | None = None):
        """keys: the device pool's keys [layers, blocks, block_size, Hk, D], from which `fill` computes the
        bounds; None: the write hook keeps them."""
        self.page_size = page_size or block_size
        if block_size % self.page_size:
            raise ValueError(f"page_size={self.page_size} must divide block_size={block_size}")
        self.pages_per_block = block_size // self.page_size
        self.block_size = block_size
        shape = (num_layers, num_blocks * self.pages_per_block, num_kv_heads, head_dim)
        self.min = torch.full(shape, float("inf"), dtype=dtype, device=device)
        self.max = torch.full(shape, float("-inf"), dtype=dtype, device=device)
        host_shape = (num_layers, num_host_blocks * self.pages_per_block, num_kv_heads, head_dim)
        self.host_min = torch.full(host_shape, float("inf"), dtype=dtype, device=device)
        self.host_max = torch.full(host_shape, float("-inf"), dtype=dtype, device=device)
        # Scratch flags: pages a write restarts; the extra last row absorbs the slots that restart nothing.
        self._fresh = torch.zeros(shape[1] + 1, dtype=torch.bool, device=device)
        self.keys = keys
        # Filled lazily: which device blocks' rows hold the bounds of their (full) keys, and per sequence
        # its first blocks (ids, on host) found ready by the last fill
        self.ready = np.zeros(num_blocks, dtype=bool)
        self._checked: dict[int, tuple[list[int], list[bool]]] = {}

    def on_write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """A write at a page's first slot starts the page afresh (its block was free and may hold another
        sequence's bounds). No host sync: safe inside CUDA graphs. Nothing when filled lazily."""
        if self.keys is not None:
            return
        pages = slots // self.page_size
        starts = torch.where(slots % self.page_size == 0, pages, self._fresh.shape[0] - 1)
        self._fresh.index_fill_(0, starts, True)
        fresh = self._fresh.index_select(0, pages)[:, None, None]
        keys = k.to(self.min.dtype)
        for bound, reduce, empty in ((self.min[layer], "amin", float("inf")), (self.max[layer], "amax", float("-inf"))):
            bound.index_copy_(0, pages, torch.where(fresh, empty, bound.index_select(0, pages)))
            bound.index_reduce_(0, pages, keys, reduce)
        self._fresh.index_fill_(0, starts, False)

    def on_move(self, moves: list[tuple[int, int]]) -> None:
        """Filled lazily, a moved block not ready gets its bounds from its device keys first (moved blocks
        are full and still hold them): host blocks are always ready, and their keys are never read back."""
        if self.keys is not None:
            self._ensure([d for d, _ in moves])
        device_pages = self._pages([d for d, _ in moves])
        host_pages = self._pages([h for _, h in moves])
        self.host_min.index_copy_(1, host_pages, self.min.index_select(1, device_pages))
        self.host_max.index_copy_(1, host_pages, self.max.index_select(1, device_pages))

    def written(self, blocks: list[int]) -> None:
        """These device blocks get new keys: their lazily filled bounds are stale."""
        self.ready[blocks] = False

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._checked.pop(seq_id, None)

    def fill(self, seq_id: int, blocks: list[int], on_host: list[bool] | None) -> None:
        """Make the bounds of sequence seq_id's first blocks (full, in position order, ids within their pool)
        exact, computing those of device blocks not ready from their keys. The blocks checked last time
        are skipped while they are still the sequence's first ones (a list comparison, no per-block work:
        they cannot change otherwise, as no one writes a full block a live sequence holds)."""
        on_host = on_host[: len(blocks)] if on_host else [False] * len(blocks)
        ids, flags = self._checked.get(seq_id, ([], []))
        start = len(ids) if blocks[: len(ids)] == ids and on_host[: len(ids)] == flags else 0
        self._ensure([b for b, host in zip(blocks[start:], on_host[start:]) if not host])
        self._checked[seq_id] = (blocks, on_host)

    def _ensure(self, blocks: list[int]) -> None:
        if not blocks:
            return
        ids = np.unique(np.asarray(blocks, dtype=np.int64))
        missing = ids[~self.ready[ids]]
        if len(missing):
            self._compute(missing.tolist())
            self.ready[missing] = True

    def _compute(self, blocks: list[int], chunk_bytes: int = 2**26) -> None:
        """The bounds of these device blocks' pages from their keys, in chunks of about chunk_bytes."""
        num_layers, _, _, num_kv_heads, head_dim = self.keys.shape
        step = max(1, chunk_bytes // (self.keys[:, 0].numel() * self.keys.element_size()))
        for i in range(0, len(blocks), step):
            chunk = blocks[i : i + step]
            keys = self.keys[:, torch.tensor(chunk, dtype=torch.int64).to(self.keys.device, non_blocking=True)]
            pages = self._pages(chunk)
            keys = keys.view(num_layers, -1, self.page_size, num_kv_heads, head_dim)
            self.min.index_copy_(1, pages, keys.amin(2).to(self.min.dtype))
            self.max.index_copy_(1, pages, keys.amax(2).to(self.max.dtype))

    def _pages(self, blocks: list[int]) -> torch.Tensor:
        ids = torch.tensor(blocks, dtype=torch.int64)[:, None] * self.pages_per_block + torch.arange(self.pages_per_block)
        return ids.flatten().to(self.min.device, non_blocking=True)

    def block_pages(self, layer: int, blocks: list[int], on_host: list[bool] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max) [len(blocks) * pages_per_block, Hk, D] of these blocks' pages, in order, from either pool."""
        pages = self._pages(blocks)
        if not on_host or not any(on_host):
            return self.min[layer].index_select(0, pages), self.max[layer].index_select(0, pages)
        host = torch.tensor(on_host).repeat_interleave(self.pages_per_block).to(pages.device, non_blocking=True)[:, None, None]
        device_rows, host_rows = torch.where(host[:, 0, 0], 0, pages), torch.where(host[:, 0, 0], pages, 0)
        lo = torch.where(host, self.host_min[layer].index_select(0, host_rows), self.min[layer].index_select(0, device_rows))
        hi = torch.where(host, self.host_max[layer].index_select(0, host_rows), self.max[layer].index_select(0, device_rows))
        return lo, hi

    def layout_pages(self, layer: int, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max) [B, max blocks * pages_per_block, Hk, D] of a decode layout's blocks' pages, from
        the device or host rows as each block lives (padding blocks read page 0; callers mask them)."""
        step = torch.arange(self.pages_per_block, device=layout.blocks.device)
        pages = (layout.blocks.clamp(min=0)[..., None] * self.pages_per_block + step).flatten(1)
        if self.host_min.shape[1] == 0:
            return self.min[layer][pages], self.max[layer][pages]
        host = layout.on_host.repeat_interleave(self.pages_per_block, 1)
        device_rows, host_rows = torch.where(host, 0, pages), torch.where(host, pages, 0)
        host = host[..., None, None]
        lo = torch.where(host, self.host_min[layer][host_rows], self.min[layer][device_rows])
        hi = torch.where(host, self.host_max[layer][host_rows], self.max[layer][device_rows])
        return lo, hi
