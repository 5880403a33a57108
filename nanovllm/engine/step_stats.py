"""The attention work of one step, per sequence, as each kind of step measures it: for the request
metrics (prefill and decode density, host KV bytes read)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from nanovllm.engine.offload.host_pool import HostKVPool
from nanovllm.engine.step_plan import StepPlan
from nanovllm.layers.block_selector import SparseStats, visible_block_pairs


@dataclass
class SeqStepStats:
    """One sequence's attention work in a step (layers and KV heads summed): (attended, visible) block
    pairs of prefill rows and (read, present) KV blocks of decode rows, and host KV bytes copied for it."""

    prefill: tuple[int, int] = (0, 0)
    decode: tuple[int, int] = (0, 0)
    host_kv_bytes: int = 0


class DeferredStats:
    """A step's work still being counted on the device (a narrowed decode step's counts per row, in a buffer
    the next step reuses; a sparse step's selections, SparseStats.device_counts), copied to the host at
    construction without waiting (queued behind the forward pass, before sampling); stats() waits for that copy
    only. A synchronous step reads it after its tokens, when the copy is done (reading it before sampling cost a
    round trip and left the GPU idle while the sampler was set up); a launched step (async scheduling) when its
    tokens arrive; a step without tokens once the next step is launched (ModelRunner._record_or_defer)."""

    def __init__(self, counts: torch.Tensor, to_stats: Callable[[list], dict[int, SeqStepStats]]):
        self._to_stats, self._stats, self._ready = to_stats, None, None
        if counts.is_cuda:
            self._counts = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._counts.copy_(counts, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._counts = counts.clone()

    def stats(self) -> dict[int, SeqStepStats]:
        if self._stats is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._stats = self._to_stats(self._counts.tolist())
        return self._stats


StepStats = dict[int, SeqStepStats] | DeferredStats


def resolved(stats: StepStats) -> dict[int, SeqStepStats]:
    """The per-sequence work, waiting for a deferred count."""
    return stats.stats() if isinstance(stats, DeferredStats) else stats


class StepWork:
    def __init__(self, block_size: int, num_layers: int, num_kv_heads: int, host_pool: HostKVPool | None):
        self.block_size, self.num_layers, self.num_kv_heads, self.host_pool = block_size, num_layers, num_kv_heads, host_pool

    def _blocks(self, seq_len: int) -> int:
        """KV blocks present for a sequence of seq_len tokens, over every layer and KV head."""
        return -(-seq_len // self.block_size) * self.num_layers * self.num_kv_heads

    def dense(self, plan: StepPlan) -> dict[int, SeqStepStats]:
        """Every layer reads every host block of the step once."""
        if not plan.has_host_blocks:
            return {}
        per_block = self.host_pool.block_bytes_per_layer * self.num_layers
        return {seq_id: SeqStepStats(host_kv_bytes=sum(flags) * per_block)
                for seq_id, flags in zip(plan.seq_ids, plan.on_host) if any(flags)}

    def fixed(self, plan: StepPlan, dense_selector: bool) -> dict[int, SeqStepStats]:
        """A dense step with fixed plans (graphs, staged copies, a step the selector leaves dense), or any
        step of a dense selector; under a sparse policy such a step counts as attending to every block
        (density 1), as SparseStats counts a selection that keeps them all."""
        stats = self.dense(plan)
        if dense_selector:
            return stats
        for seq_id, q, n in zip(plan.seq_ids, plan.query_lens, plan.seq_lens):
            work = {"decode": (self._blocks(n),) * 2} if q == 1 else {"prefill": (self._visible_pairs(q, n),) * 2}
            stats[seq_id] = replace(stats.get(seq_id, SeqStepStats()), **work)
        return stats

    def _visible_pairs(self, query_len: int, seq_len: int) -> int:
        """Causal (query block, KV block) pairs of a prefill row, over every layer and KV head."""
        first, n = (seq_len - query_len) // self.block_size, -(-seq_len // self.block_size)
        return visible_block_pairs(first, n) * self.num_layers * self.num_kv_heads

    @staticmethod
    def sparse(plan: StepPlan, sparse: SparseStats) -> dict[int, SeqStepStats]:
        """What a sparse selection counted, layer by layer."""
        return {seq_id: SeqStepStats(tuple(p), tuple(d), b)
                for seq_id, p, d, b in zip(plan.seq_ids, sparse.prefill, sparse.decode, sparse.host_bytes)}

    def narrowed(self, plan: StepPlan, counts: list[list[int]], per_block: int = 1) -> dict[int, SeqStepStats]:
        """A narrowed decode step (engine/narrowed.py) from its counts per row (columns read, host columns
        read in place, host columns read half: keys alone by the selection, or values alone where the keys come
        from the selector's key codes; per_block columns make a block:
        pages count as their share of a block and of its bytes); the host bytes are added to the pool's
        transfer counts too."""
        column_bytes = self.host_pool.block_bytes_per_layer // self.num_kv_heads // per_block if self.host_pool else 0
        stats = {seq_id: SeqStepStats(decode=(read if per_block == 1 else read / per_block, self._blocks(n)),
                                      host_kv_bytes=host * column_bytes + keys * (column_bytes // 2))
                 for seq_id, n, (read, host, keys) in zip(plan.seq_ids, plan.seq_lens, counts)}
        if self.host_pool:
            self.host_pool.stats.h2d_bytes += sum(s.host_kv_bytes for s in stats.values())
        return stats
