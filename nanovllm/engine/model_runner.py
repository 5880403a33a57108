"""The engine's view of model execution: a host-side `StepPlanner` and a device `Worker`.

With tensor_parallel_size N > 1 this process is rank 0 of a `TensorParallelGroup`: each plan goes to the
N - 1 worker processes as well as to the local worker, and only the local worker's results come back.

`run` / `launch` turn a scheduled step into a `StepPlan` (engine/step_plan.py, no device work) and
have the worker execute it (engine/worker.py); results that belong to sequences (prompt logprobs,
tokens still on their way from the device) are put back in place here.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from nanovllm.config import EngineConfig
from nanovllm.distributed.executor import TensorParallelGroup
from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_plan import StepPlanner
from nanovllm.engine.step_stats import DeferredStats, SeqStepStats, StepStats, resolved
from nanovllm.engine.worker import Worker
from nanovllm.layers.block_selector import BlockSelector


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path | None):
        self.tp_group = TensorParallelGroup(config, model_dir) if config.tensor_parallel_size > 1 else None
        if self.tp_group is None:
            self.worker = Worker(config, model_dir)
        else:
            with self.tp_group.guard():
                self.worker = Worker(config, model_dir, self.tp_group.tp)
        self.planner = StepPlanner(self.worker.limits)
        # work of steps without tokens still counted on the device, read once a later step is launched
        self._unread_work: list[tuple[list[ScheduledSeq], DeferredStats]] = []
        self.planner.dense_decode = self.worker.selector.dense_for_decode
        self.planner.narrowed_decode = self.worker.selector.narrowed_decode

    # What benchmarks and tests look at, on the worker.
    device = property(lambda self: self.worker.device)
    dtype = property(lambda self: self.worker.dtype)
    model = property(lambda self: self.worker.model)
    backend = property(lambda self: self.worker.backend)
    layer_ops = property(lambda self: self.worker.layer_ops)
    kv_cache = property(lambda self: self.worker.kv_cache)
    graphs = property(lambda self: self.worker.graphs)
    host_pool = property(lambda self: self.worker.host_pool)
    num_blocks = property(lambda self: self.worker.num_blocks)
    num_host_blocks = property(lambda self: self.worker.num_host_blocks)
    kv_shape = property(lambda self: self.worker.kv_shape)
    bytes_per_block = property(lambda self: self.worker.bytes_per_block)
    default_generator = property(lambda self: self.worker.default_generator)

    @property
    def staged_decode(self) -> bool:
        """Offload decode steps whose host KV fits a ring slot are staged (in graphs); False: every such
        step takes the split path (a benchmark peer)."""
        return self.planner.limits.staged_max_blocks > 0

    @staged_decode.setter
    def staged_decode(self, on: bool) -> None:
        limits = self.worker.limits
        self.planner.limits = replace(limits, staged_max_blocks=limits.staged_max_blocks if on else 0)

    def set_block_selector(self, selector: BlockSelector) -> None:
        """Which KV blocks each layer attends to (layers/block_selector.py). Decode steps the selector
        narrows turn off what plans copies for all layers at once: decode graphs and staged offload."""
        if self.tp_group is not None:
            raise ValueError("set_block_selector needs tensor_parallel_size=1; with more ranks choose the "
                             "sparse_policy option, which each rank builds over its own KV heads")
        self.worker.set_block_selector(selector)
        self.planner.dense_decode = selector.dense_for_decode
        self.planner.narrowed_decode = selector.narrowed_decode

    def recapture_decode_graphs(self) -> None:
        """After the block selector (or its budget) changed: decode graphs for it, narrowed ones included."""
        if self.tp_group is not None:
            raise ValueError("recapture_decode_graphs needs tensor_parallel_size=1")
        staged = self.staged_decode
        self.worker.recapture_graphs()
        self.planner.limits = self.worker.limits
        self.staged_decode = staged

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the runner cannot run steps afterwards."""
        if self.tp_group is not None:
            self.tp_group.shutdown()

    def release(self, seq: Sequence) -> None:
        """seq is finished: the worker may drop its per-request state with the next step."""
        self.planner.release(seq.seq_id)

    def run(self, scheduled: list[ScheduledSeq], offloads: list[tuple[int, int]] = ()
            ) -> dict[int, tuple[int, dict[int, float] | None]]:
        """One forward pass; returns {seq_id: (sampled token, logprobs)} for sequences that sample.
        offloads: (device block, host block) pairs the block manager moved out since the last step."""
        plan = self.planner.plan(scheduled, offloads)
        out = self.worker.execute(plan) if self.tp_group is None else self.tp_group.run(self.worker, "execute", plan)
        for item in scheduled:
            if item.seq.seq_id in out.prompt_logprobs:
                item.seq.prompt_logprobs.extend(out.prompt_logprobs[item.seq.seq_id])
        self._record_unread_work()
        self._record_or_defer(scheduled, out.stats)
        return out.sampled

    def launch(self, scheduled: list[ScheduledSeq], offloads: list[tuple[int, int]] = ()) -> PendingTokens:
        """Like run() without logprobs, but nothing waits for the device: the sampled tokens stay there
        (also as the next step's inputs where a sequence's last token is a PLACEHOLDER) and are copied
        to the host in the background."""
        plan = self.planner.plan(scheduled, offloads, launched=True)
        tokens, stats = self.worker.launch(plan) if self.tp_group is None else \
            self.tp_group.run(self.worker, "launch", plan)
        self._record_unread_work()
        if tokens is None:
            self._record_or_defer(scheduled, stats)
            return PendingTokens([], None, lambda: None)
        seqs = [item.seq for item in scheduled if item.samples]
        return PendingTokens(seqs, tokens, lambda: _record_work(scheduled, resolved(stats)))

    def _record_or_defer(self, scheduled: list[ScheduledSeq], stats: StepStats) -> None:
        """A step's work added to its sequences now, or, still on the device, once a later step is launched
        (`_record_unread_work`): a step without tokens (a prompt's chunk) then leaves the device busy with no
        wait between it and the next. Every prompt's last step has tokens, so its work is complete with them."""
        if isinstance(stats, DeferredStats):
            self._unread_work.append((scheduled, stats))
        else:
            _record_work(scheduled, stats)

    def _record_unread_work(self) -> None:
        """The work of earlier steps deferred by `_record_or_defer`: their counts were queued before this step's
        work, so reading them waits for that copy only."""
        for scheduled, stats in self._unread_work:
            _record_work(scheduled, stats.stats())
        self._unread_work.clear()


def _record_work(scheduled: list[ScheduledSeq], stats: dict[int, SeqStepStats]) -> None:
    """Add a step's attention work (densities, host KV bytes) to its sequences' running totals."""
    if not stats:
        return
    for item in scheduled:
        work = stats.get(item.seq.seq_id)
        if work is not None:
            item.seq.add_attention_work(work.prefill, work.decode, work.host_kv_bytes)


class PendingTokens:
    """Tokens sampled by a launched step, on their way to the host, and the step's attention work
    (record_work adds it to the sequences' totals; it may wait for the device, as tolist does)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor | None, record_work: Callable[[], None]):
        self.seqs, self.record_work = seqs, record_work
        self.ready: torch.cuda.Event | None = None
        self.host = tokens
        if tokens is not None and tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return [] if self.host is None else self.host.tolist()
