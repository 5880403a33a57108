"""CUDA graphs for decode steps: model forward plus logits, captured once per batch-size bucket.

A decode step of B sequences is padded to the smallest captured bucket >= B. Padding rows write
their KV into a scratch block that no sequence owns, so they never touch real cache entries.
Per-step inputs are copied into static tensors; nothing on the replay path waits for the GPU.
"""
from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanovllm.engine.graph_copies import GraphCopies
from nanovllm.host_arrays import fill_tables
from nanovllm.layers.attention import AttentionMetadata
from nanovllm.layers.kv_access import KVAccess


def resolve_placeholders(ids: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """ids with each -(row + 1) replaced by last_tokens[row], on the device (no host sync)."""
    return torch.where(ids < 0, last_tokens[(-1 - ids).clamp(min=0)], ids)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: nn.Module, make_kv: Callable[[AttentionMetadata, str], KVAccess], buckets: list[int],
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, device: torch.device,
                 last_tokens: torch.Tensor, staged=None, narrowed_buckets: list[int] | None = None):
        """make_kv(meta, mode): the KV access a graph of mode "plain", "staged" or "narrowed" is captured
        with; last_tokens: where an input id -(row + 1) is read from (the previous step's sampled tokens);
        staged: the offload `StagedCopies`, or None. With it, a second set of graphs is captured with staged
        KV access (they copy host-resident KV into a ring slot, with addresses it sets before each replay)
        for steps with host KV; steps without replay the plain graphs, free of the copies' cross-stream
        dependencies. narrowed_buckets: the buckets that also get a graph of the block selector's narrowed
        decode steps (engine/narrowed.py)."""
        self.model, self.make_kv, self.offload = model, make_kv, staged
        self.narrowed_buckets = narrowed_buckets or []
        self.last_tokens = last_tokens
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.buckets = buckets
        n = self.buckets[-1]
        # Per row: token id, position, KV slot, then the block table. One pinned staging copy on the host,
        # filled in place each step, and one host-to-device copy of the rows in use.
        self.staging = torch.empty(n, 3 + max_blocks_per_seq, dtype=torch.int64, pin_memory=True)
        self.rows = torch.empty(n, 3 + max_blocks_per_seq, dtype=torch.int64, device=device)
        self._fill_padding(self.staging.numpy(), 0, n)
        self.rows.copy_(self.staging)
        self.staged = torch.cuda.Event()  # the last copy out of staging (it is refilled only after it)
        self.staged.record()
        self.input_ids, self.positions, self.slot_mapping = self.rows[:, 0], self.rows[:, 1], self.rows[:, 2]
        self.block_tables = self.rows[:, 3:]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # positions + 1, computed in the graph
        self.cu_query_lens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.staged_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.staged_logits: dict[int, torch.Tensor] = {}
        self.copies: dict[int, GraphCopies] = {}
        self.narrowed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.narrowed_logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.num_staged_replays = 0
        self.num_narrowed_replays = 0
        self._capture_all()

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_lens=[1] * bs, seq_lens=[1] * bs, block_tables=[], slot_mapping=self.slot_mapping[:bs],
            cu_query_lens=self.cu_query_lens[: bs + 1], seq_lens_tensor=self.seq_lens[:bs],
            block_tables_tensor=self.block_tables[:bs], block_size=self.block_size,
        )

    def _forward(self, bs: int, mode: str = "plain") -> torch.Tensor:
        self.seq_lens[:bs].copy_(self.positions[:bs] + 1)
        ids = resolve_placeholders(self.input_ids[:bs], self.last_tokens)
        hidden = self.model(ids, self.positions[:bs], self.make_kv(self._metadata(bs), mode))
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        """Every graph, with Python's cyclic GC held off: an earlier engine's graphs freed by a collection in
        mid-capture would be destroyed inside this capture, which invalidates it."""
        gc.collect()
        gc.disable()
        try:
            self._capture_modes()
        finally:
            gc.enable()

    @torch.inference_mode()
    def _capture_modes(self) -> None:
        pool = None
        modes = [("plain", self.buckets)] + ([("staged", self.buckets)] if self.offload is not None else []) + \
            ([("narrowed", self.narrowed_buckets)] if self.narrowed_buckets else [])
        for mode, buckets in modes:
            for bs in reversed(buckets):  # largest first so smaller graphs reuse its memory pool
                self._forward(bs, mode)  # warm-up: compiles kernels and allocates outside the graph
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph(keep_graph=mode == "staged")
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(bs, mode)
                pool = graph.pool()
                if mode == "plain":
                    self.graphs[bs], self.logits[bs] = graph, logits
                elif mode == "narrowed":
                    self.narrowed_graphs[bs], self.narrowed_logits[bs] = graph, logits
                else:  # its host->device copies get new addresses before each replay
                    graph.instantiate()
                    self.copies[bs] = GraphCopies(graph, self.offload.placeholders)
                    self.staged_graphs[bs], self.staged_logits[bs] = graph, logits
        torch.cuda.synchronize(self.device)

    def _fill_padding(self, rows: np.ndarray, start: int, end: int) -> None:
        """Rows [start, end): token 0 at position 0 writing to the scratch block; tables all scratch."""
        rows[start:end, :2] = 0
        rows[start:end, 2] = self.scratch_block * self.block_size
        rows[start:end, 3:] = self.scratch_block

    def run(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            bs: int, mode: str = "plain") -> torch.Tensor:
        """Replay the decode graph of bucket bs for len(token_ids) <= bs sequences; returns their logits
        [B, vocab]. mode "staged": the tables name ring positions (StagedCopies holds the step's copies);
        "narrowed": host blocks are RING_BASE + host id (engine/narrowed.py)."""
        b = len(token_ids)
        self.staged.synchronize()  # with async scheduling the previous step's copy may still be queued
        rows = self.staging.numpy()
        rows[:b, 0], rows[:b, 1], rows[:b, 2] = token_ids, positions, slots
        rows[:b, 3:] = self.scratch_block
        fill_tables(rows[:b, 3:], block_tables)
        self._fill_padding(rows, b, bs)  # rows left from a larger batch must not write real KV slots
        self.rows[:bs].copy_(self.staging[:bs], non_blocking=True)
        self.staged.record()
        self.num_replays += 1
        if mode == "plain":
            self.graphs[bs].replay()
            return self.logits[bs][:b]
        if mode == "narrowed":
            self.narrowed_graphs[bs].replay()
            self.num_narrowed_replays += 1
            return self.narrowed_logits[bs][:b]
        self.offload.update_graph(self.copies[bs])
        self.staged_graphs[bs].replay()
        self.num_staged_replays += 1
        return self.staged_logits[bs][:b]
