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

`BlockKeyCopy` (quest_key_copy="int8") keeps instead an int8 copy of every key, filled the same lazy way
(`LazyKeyMetadata` is what the two share): Quest then ranks each page by its exact largest score.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from nanovllm.kernels.reference import KeyCodes

# PyTorch warns on every first use that index_reduce_ is in beta; its amin/amax are what the bounds need.
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")


class LazyKeyMetadata:
    """What lazily filled key metadata shares: which device blocks' rows are ready, and per sequence its first
    blocks found ready by the last fill. Subclasses compute a block's rows from `keys` (`_compute`) and, as
    `KVHook`s, copy a moving block's rows to its host rows (`on_move`)."""

    def __init__(self, num_blocks: int, keys: torch.Tensor | None):
        self.keys = keys
        self.ready = np.zeros(num_blocks, dtype=bool)
        self._checked: dict[int, tuple[list[int], list[bool]]] = {}

    def written(self, blocks: list[int]) -> None:
        """These device blocks get new keys: their lazily filled rows are stale."""
        self.ready[blocks] = False

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._checked.pop(seq_id, None)

    def fill(self, seq_id: int, blocks: list[int], on_host: list[bool] | None) -> None:
        """Make the rows of sequence seq_id's first blocks (full, in position order, ids within their pool)
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

    def _compute(self, blocks: list[int]) -> None:
        raise NotImplementedError


class BlockKeyBounds(LazyKeyMetadata):
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
        super().__init__(num_blocks, keys)

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


class BlockKeyCopy(LazyKeyMetadata):
    """A quantized copy of the keys of layers first_layer.. of the device pool `keys` [layers, blocks, block_size,
    Hk, D]: per token and KV head the codes round(k / s) and the scale s = max |k| / 127 (bits=8, D + 4 bytes per
    token and KV head: 0.52x the keys' bf16 bytes) or max |k| / 7 (bits=4, two codes per byte, dimension 2i in the
    low nibble and 2i + 1 in the high: D / 2 + 4 bytes, 0.27x), so k ~ s * codes. Like the bounds it lives on the
    device for every block, device- and host-resident alike, and is filled lazily: a block's rows are computed
    from its keys when a selection first needs them or when it moves to the host. Quest scores each page exactly
    through it (its largest q . k), which needs no bound and, in offload mode, no host key read."""

    def __init__(self, keys: torch.Tensor, num_host_blocks: int, first_layer: int = 0, page_size: int = 16,
                 bits: int = 8):
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = keys.shape
        if block_size % page_size:
            raise ValueError(f"page_size={page_size} must divide block_size={block_size}")
        if bits not in (4, 8) or head_dim * bits % 8:
            raise ValueError(f"a key copy has 8 or 4 bits per code (4: an even head_dim), got bits={bits}, "
                             f"head_dim={head_dim}")
        super().__init__(num_blocks, keys)
        self.first_layer, self.block_size, self.page_size, self.bits = first_layer, block_size, page_size, bits
        self.pages_per_block = block_size // page_size
        layers, device, width = num_layers - first_layer, keys.device, head_dim * bits // 8
        rows, host_rows = num_blocks * block_size, num_host_blocks * block_size
        self.codes = torch.zeros(layers, rows, num_kv_heads, width, dtype=torch.int8, device=device)
        self.scales = torch.zeros(layers, rows, num_kv_heads, dtype=torch.float32, device=device)
        self.host_codes = torch.zeros(layers, host_rows, num_kv_heads, width, dtype=torch.int8, device=device)
        self.host_scales = torch.zeros(layers, host_rows, num_kv_heads, dtype=torch.float32, device=device)
        # per layer, views made once (the decode step asks for them in every sparse layer)
        self._layers = [(self.codes[i], self.scales[i], self.host_codes[i], self.host_scales[i]) for i in range(layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, bits: int = 8) -> int:
        return num_layers * block_size * num_kv_heads * (head_dim * bits // 8 + 4)

    def on_write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Filled lazily: writes only make blocks stale (`written`)."""

    def on_move(self, moves: list[tuple[int, int]]) -> None:
        self._ensure([d for d, _ in moves])
        device_rows, host_rows = self._rows([d for d, _ in moves]), self._rows([h for _, h in moves])
        self.host_codes.index_copy_(1, host_rows, self.codes.index_select(1, device_rows))
        self.host_scales.index_copy_(1, host_rows, self.scales.index_select(1, device_rows))

    def _compute(self, blocks: list[int], chunk_bytes: int = 2**26) -> None:
        keys = self.keys[self.first_layer :]
        if keys.shape[0] == 0:  # every layer dense: nothing to copy
            return
        step = max(1, chunk_bytes // (keys[:, 0].numel() * 4))
        for i in range(0, len(blocks), step):
            chunk = blocks[i : i + step]
            k = keys[:, torch.tensor(chunk, dtype=torch.int64).to(keys.device, non_blocking=True)].float()
            codes, scales = quantize_keys(k.flatten(1, 2), self.bits)  # [layers, rows, Hk, D]
            rows = self._rows(chunk)
            self.codes.index_copy_(1, rows, codes)
            self.scales.index_copy_(1, rows, scales)

    def _rows(self, blocks: list[int]) -> torch.Tensor:
        ids = torch.tensor(blocks, dtype=torch.int64)[:, None] * self.block_size + torch.arange(self.block_size)
        return ids.flatten().to(self.codes.device, non_blocking=True)

    def layer_arrays(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, host codes, host scales) of a model layer (one at or past first_layer)."""
        return self._layers[layer - self.first_layer]

    def host_key_codes(self, layer: int) -> KeyCodes:
        """A model layer's host blocks' keys as the copy holds them, in the host pool's block layout (int8 only)."""
        if self.bits != 8:
            raise ValueError(f"attention reads keys from an int8 copy only, this one has {self.bits} bits")
        _, _, codes, scales = self.layer_arrays(layer)
        return KeyCodes(codes.view(-1, self.block_size, *codes.shape[1:]), scales.view(-1, self.block_size,
                                                                                          scales.shape[-1]))

    def block_keys(self, layer: int, blocks: list[int], on_host: list[bool] | None) -> torch.Tensor:
        """[len(blocks) * block_size, Hk, D] float32 keys of these blocks (ids within their pool) as the copy
        holds them, in order."""
        rows = self._rows(blocks)[None]
        host = torch.tensor(on_host or [False] * len(blocks)).repeat_interleave(self.block_size)[None]
        return self._dequantized(layer, rows, host.to(rows.device))[0]

    def layout_keys(self, layer: int, layout) -> torch.Tensor:
        """[B, W * block_size, Hk, D] float32 keys of a decode layout's blocks as the copy holds them (padding
        blocks read block 0's; callers mask them)."""
        step = torch.arange(self.block_size, device=layout.blocks.device)
        rows = (layout.blocks.clamp(min=0)[..., None] * self.block_size + step).flatten(1)
        return self._dequantized(layer, rows, layout.on_host.repeat_interleave(self.block_size, 1))

    def _dequantized(self, layer: int, rows: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """[B, N, Hk, D] float32 keys of rows [B, N], host rows where host [B, N] is set."""
        codes, scales, host_codes, host_scales = self.layer_arrays(layer)
        device_rows = torch.where(host, 0, rows)
        keys = unpack_codes(codes[device_rows], self.bits).float() * scales[device_rows][..., None]
        if host_codes.shape[0] == 0:
            return keys
        host_rows = torch.where(host, rows, 0)
        host_keys = unpack_codes(host_codes[host_rows], self.bits).float() * host_scales[host_rows][..., None]
        return torch.where(host[..., None, None], host_keys, keys)


def quantize_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float keys [..., D] -> (codes [..., D * bits / 8] int8, scales [...] float32): symmetric, one scale per row
    (max |k| / 127 or / 7); 4 bits: dimension 2i in a byte's low nibble, 2i + 1 in its high one."""
    top = 127 if bits == 8 else 7
    scales = k.abs().amax(-1) / top
    codes = (k / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round().clamp(-top, top).to(torch.int8)
    if bits == 4:
        codes = (codes[..., 0::2] & 0xF) | (codes[..., 1::2] << 4)
    return codes, scales


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """quantize_keys' codes [..., D * bits / 8] as one int8 code per dimension [..., D]."""
    if bits == 8:
        return codes
    low, high = (codes << 4) >> 4, codes >> 4  # arithmetic shifts: the nibbles' signs
    return torch.stack((low, high), -1).flatten(-2)
