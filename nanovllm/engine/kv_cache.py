"""The paged KV pool: per layer, keys and values of shape [num_blocks, block_size, kv_heads, head_dim].

`write` is the one place where new K/V enters the cache. Policies that keep per-block metadata (for
example per-block key bounds, layers/block_metadata.py) register a `KVHook`: it sees every write, and
every move of a block between the device pool and the host pool, so it can keep its metadata for both.
"""
from __future__ import annotations

from typing import Protocol

import torch


class KVHook(Protocol):
    def on_write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """New k, v [T, Hk, D] were stored at flat device slots (block * block_size + offset)."""

    def on_move(self, moves: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs now live in the host pool (the device ids may be reused)."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.data = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.hooks: list[KVHook] = []
        self._layers = [(self.data[0, i], self.data[1, i]) for i in range(num_layers)]  # views made once

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[4]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new k, v [T, Hk, D] at flat slots [T], then tell the hooks."""
        k_cache, v_cache = self.layer(layer)
        store_kv(k, v, k_cache, v_cache, slots)
        self.written(layer, k, v, slots)

    def written(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v were stored at slots by the op that made them (a KVAccess.write_target): tell the hooks."""
        for hook in self.hooks:
            hook.on_write(layer, k, v, slots)

    def moved_to_host(self, moves: list[tuple[int, int]]) -> None:
        for hook in self.hooks:
            hook.on_move(moves)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, Hk, D] at the caches' flat slots [T]: on CUDA one Triton launch (kernels/triton_fused.py),
    else two index_copy_ (its reference)."""
    if k.is_cuda and k.dtype == k_cache.dtype == v.dtype == v_cache.dtype and k.stride(-1) == v.stride(-1) == 1:
        from nanovllm.kernels.triton_fused import store_kv as store_kv_triton

        return store_kv_triton(k, v, k_cache, v_cache, slots)
    num_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, v)
