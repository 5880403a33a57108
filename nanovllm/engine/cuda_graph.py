"""CUDA graphs for decode steps: model forward plus logits, captured once per batch-size bucket.

A decode step of B sequences is padded to the smallest captured bucket >= B. Padding rows write
their KV into a scratch block that no sequence owns, so they never touch real cache entries.
Per-step inputs are copied into static tensors; nothing on the replay path waits for the GPU.
"""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.attention import AttentionBackend, AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: nn.Module, backend: AttentionBackend, kv_cache, max_batch: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, device: torch.device):
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int64, device=device)
        self.cu_query_lens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_lens=[1] * bs, seq_lens=[1] * bs, block_tables=[], slot_mapping=self.slot_mapping[:bs],
            cu_query_lens=self.cu_query_lens[: bs + 1], seq_lens_tensor=self.seq_lens[:bs],
            block_tables_tensor=self.block_tables[:bs], block_size=self.block_size,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_cache, self._metadata(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.buckets):  # largest first so smaller graphs reuse its memory pool
            self._forward(bs)  # warm-up: compiles kernels and allocates outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def run(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Replay the decode graph for len(token_ids) sequences; returns their logits [B, vocab]."""
        b = len(token_ids)
        bs = next(size for size in self.buckets if size >= b)
        width = self.block_tables.shape[1]
        pad = bs - b
        padded = [t + [self.scratch_block] * (width - len(t)) for t in block_tables]
        tables = torch.tensor(padded + [[self.scratch_block] * width] * pad, dtype=torch.int64)
        host = {
            "ids": torch.tensor(token_ids + [0] * pad, dtype=torch.int64),
            "pos": torch.tensor(positions + [0] * pad, dtype=torch.int64),
            "slots": torch.tensor(slots + [self.scratch_block * self.block_size] * pad, dtype=torch.int64),
            "lens": torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32),
        }
        self.input_ids[:bs].copy_(host["ids"].pin_memory(), non_blocking=True)
        self.positions[:bs].copy_(host["pos"].pin_memory(), non_blocking=True)
        self.slot_mapping[:bs].copy_(host["slots"].pin_memory(), non_blocking=True)
        self.seq_lens[:bs].copy_(host["lens"].pin_memory(), non_blocking=True)
        self.block_tables[:bs].copy_(tables.pin_memory(), non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[bs][:b]
