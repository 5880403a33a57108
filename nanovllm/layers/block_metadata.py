"""Per-block metadata that sparse policies keep through the KV-write hook (engine/kv_cache.py).

`BlockKeyBounds` keeps, per layer, block and KV head, the elementwise min and max of the keys written
into the block so far (post-RoPE): what Quest's upper bound on a block's attention scores needs. It
lives on the cache's device for every block, device- and host-resident alike: a write updates the
device block's bounds, a move to the host copies them to the host block's row.
"""
from __future__ import annotations

import torch


class BlockKeyBounds:
    def __init__(self, num_layers: int, num_blocks: int, num_host_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device):
        shape = (num_layers, num_blocks, num_kv_heads, head_dim)
        self.block_size = block_size
        self.min = torch.full(shape, float("inf"), dtype=torch.float32, device=device)
        self.max = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
        host_shape = (num_layers, num_host_blocks, num_kv_heads, head_dim)
        self.host_min = torch.full(host_shape, float("inf"), dtype=torch.float32, device=device)
        self.host_max = torch.full(host_shape, float("-inf"), dtype=torch.float32, device=device)
        # Scratch flags: blocks a write restarts; the extra last row absorbs the slots that restart nothing.
        self._fresh = torch.zeros(num_blocks + 1, dtype=torch.bool, device=device)

    def on_write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """A write at offset 0 starts the block afresh (it was free and may hold another sequence's bounds).
        No host sync: safe inside CUDA graphs."""
        blocks = slots // self.block_size
        starts = torch.where(slots % self.block_size == 0, blocks, self._fresh.shape[0] - 1)
        self._fresh.index_fill_(0, starts, True)
        fresh = self._fresh.index_select(0, blocks)[:, None, None]
        keys = k.float()
        for bound, reduce, empty in ((self.min[layer], "amin", float("inf")), (self.max[layer], "amax", float("-inf"))):
            bound.index_copy_(0, blocks, torch.where(fresh, empty, bound.index_select(0, blocks)))
            bound.index_reduce_(0, blocks, keys, reduce)
        self._fresh.index_fill_(0, starts, False)

    def on_move(self, moves: list[tuple[int, int]]) -> None:
        device_ids = torch.tensor([d for d, _ in moves], dtype=torch.int64).to(self.min.device, non_blocking=True)
        host_ids = torch.tensor([h for _, h in moves], dtype=torch.int64).to(self.min.device, non_blocking=True)
        self.host_min.index_copy_(1, host_ids, self.min.index_select(1, device_ids))
        self.host_max.index_copy_(1, host_ids, self.max.index_select(1, device_ids))
