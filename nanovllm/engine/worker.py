"""The device worker: executes `StepPlan`s on one device.

It owns what lives on the device: the model, the paged KV pool (and with offload the pinned host pool,
ring and copy streams), the decode CUDA graphs, the sampling generators and the last launched step's
sampled tokens. Per step it picks the KV-access strategy the plan calls for, runs the model, and
samples. It never schedules: everything it needs arrives in the plan.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanovllm.config import QUEST_KEY_COPY_BITS, EngineConfig
from nanovllm.distributed.parallel_state import SINGLE, TensorParallel, broadcast_from_driver, min_over_ranks
from nanovllm.engine import graph_copies
from nanovllm.engine.cuda_graph import DecodeGraphs, batch_buckets, resolve_placeholders
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.narrowed import NarrowedDecode
from nanovllm.engine.memory import (host_kv_bytes, kv_blocks_that_fit, readable_size, resolve_backend, resolve_device,
                                    resolve_dtype)
from nanovllm.engine.offload import offload_kv_access
from nanovllm.engine.offload.host_pool import RING_SLOTS, HostKVPool, ring_blocks_for
from nanovllm.engine.offload.staged import StagedCopies, StagedKV, ring_tables
from nanovllm.engine.step_plan import STEP_KINDS, StepPlan, WorkerLimits
from nanovllm.engine.step_stats import DeferredStats, SeqStepStats, StepStats, StepWork, resolved
from nanovllm.engine.warm_up import compile_step_variants
from nanovllm.host_arrays import list_to_device
from nanovllm.layers.attention import AttentionMetadata, get_attention_backend
from nanovllm.layers.block_metadata import BlockKeyCopy
from nanovllm.layers.block_selector import BlockSelector, DenseSelector, SparseStats
from nanovllm.layers.fused_ops import get_layer_ops
from nanovllm.layers.kv_access import DeviceKV, KVAccess
from nanovllm.layers.sampler import logprob_entries, sample, sample_on_device
from nanovllm.layers.sparse_policies import build_sparse_policy
from nanovllm.models.loader import build_model


@dataclass
class StepOutput:
    sampled: dict[int, tuple[int, dict[int, float] | None]]  # seq_id -> (token, logprobs)
    prompt_logprobs: dict[int, list[dict[int, float]]]  # seq_id -> entries for this step's prompt rows
    # seq_id -> work, where there is any to report; deferred where the device counted it (read it with `resolved`)
    stats: StepStats = field(default_factory=dict)


DENSE = DenseSelector()


class Worker:
    """tp: this worker's rank of the tensor-parallel group; it holds its own heads' weights and KV, and only
    rank 0 samples (the others receive the tokens of launched steps as inputs of the next)."""

    def __init__(self, config: EngineConfig, model_dir: Path | None, tp: TensorParallel = SINGLE):
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device)
        if tp.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, config.hf_config, self.device)
        self.block_size = config.kvcache_block_size
        self.backend = get_attention_backend(resolve_backend(config.attention_backend, self.device))
        self.layer_ops = get_layer_ops("triton" if self.backend.name == "triton" else "torch")
        self.model = build_model(config.hf_config, self.dtype, self.device, model_dir, config.seed, self.layer_ops, tp)
        mc = self.model.config
        self.kv_shape = (mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.bytes_per_block = PagedKVCache.bytes_per_block(*self.kv_shape, self.dtype)
        self.num_blocks = config.num_gpu_blocks or self._blocks_that_fit()
        if tp.size > 1:  # one block table serves every rank: the smallest pool
            self.num_blocks = min_over_ranks(self.num_blocks)
        # One extra block past the pool: a scratch target for padded rows; the block manager never hands it out.
        self.kv_cache = PagedKVCache(mc.num_layers, self.num_blocks + 1, *self.kv_shape[1:], self.dtype, self.device)
        self.host_pool = self._make_host_pool() if config.enable_cpu_offload else None
        # Decode steps with host KV staged in CUDA graphs need the runtime's graph-update calls.
        can_stage = self.host_pool is not None and (not self.host_pool.cuda or graph_copies.available())
        self.staged = StagedCopies(self.host_pool) if can_stage else None
        self.selector: BlockSelector = build_sparse_policy(config, self.kv_cache, self.host_pool)
        self.narrowed = NarrowedDecode(self.selector, self.kv_cache, self.backend, self.host_pool, self.block_size,
                                       config.max_num_seqs)
        self.work = StepWork(self.block_size, self.kv_shape[0], self.kv_shape[2], self.host_pool)
        self.default_generator = torch.Generator(self.device).manual_seed(config.seed)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded request
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.graphs = self._capture_graphs()
        # host seconds in steps' forward passes by kind (STEP_KINDS): on CUDA the time to launch their kernels or
        # replay their graph (the device runs behind), the whole pass on the CPU; from after the start-up steps
        self.forward_seconds = [0.0] * len(STEP_KINDS)
        if self.device.type == "cuda":
            compile_step_variants(self)
        self.forward_seconds = [0.0] * len(STEP_KINDS)

    @property
    def limits(self) -> WorkerLimits:
        return WorkerLimits(self.block_size, self.graphs.buckets if self.graphs else None, self.host_pool is not None,
                            self.host_pool.ring_blocks if self.staged else 0,
                            self.staged.min_copy_blocks if self.staged else 1,
                            self.graphs.narrowed_buckets if self.graphs else None)

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_host_blocks if self.host_pool else 0

    # ---- set-up ----------------------------------------------------------------------------
    def _ring_blocks(self) -> int:
        return ring_blocks_for(self.bytes_per_block // self.kv_shape[0])

    def _host_blocks(self) -> int:
        return int(host_kv_bytes(self.config) // self.bytes_per_block)

    def _mirrored_layers(self) -> int:
        """Quest's dense layers read every block each step: in offload mode their KV stays on the device (and
        they need no key copy)."""
        return min(self.config.quest_dense_layers, self.kv_shape[0]) if "quest" in self.config.sparse_policy else 0

    def _make_host_pool(self) -> HostKVPool:
        host_blocks = self._host_blocks()
        if host_blocks < 1:
            raise ValueError(f"cpu_kv_cache_gb={self.config.cpu_kv_cache_gb} holds no KV block "
                             f"({self.bytes_per_block} bytes each)")
        return HostKVPool(self.kv_cache, host_blocks, self._ring_blocks(), self._mirrored_layers())

    def _key_copy_bytes_per_block(self) -> int:
        """Device bytes of Quest's key copy (quest_key_copy) per block of either pool."""
        if "quest" not in self.config.sparse_policy or self.config.quest_key_copy == "none":
            return 0
        return BlockKeyCopy.bytes_per_block(self.kv_shape[0] - self._mirrored_layers(), *self.kv_shape[1:],
                                            QUEST_KEY_COPY_BITS[self.config.quest_key_copy])

    def _blocks_that_fit(self) -> int:
        """Reserved beside the device pool in offload mode: the ring, the mirrored layers' host blocks and
        the host blocks' key copy."""
        per_layer_block, copy = self.bytes_per_block // self.kv_shape[0], self._key_copy_bytes_per_block()
        reserved = (RING_SLOTS * self._ring_blocks() + self._host_blocks() * self._mirrored_layers()) * per_layer_block
        reserved += self._host_blocks() * copy
        return kv_blocks_that_fit(self.config, self.device, self.bytes_per_block + copy,
                                  reserved if self.config.enable_cpu_offload else 0, self._warm_up_peak,
                                  self._reserved_for(copy))

    def _reserved_for(self, copy_bytes_per_block: int) -> str:
        """What the offload reservation holds, for the error when nothing is left for the device pool."""
        parts, mirrored = ["the copy ring"], self._mirrored_layers()
        if mirrored:
            parts.append(f"the dense layers' device copy of the host blocks (quest_dense_layers={mirrored})")
        if copy_bytes_per_block:
            size = readable_size(self._host_blocks() * copy_bytes_per_block)
            parts.append(f"Quest's {self.config.quest_key_copy} key copy of {self._host_blocks()} host blocks "
                         f"({size}; quest_key_copy='int4' halves it, 'none' or a smaller cpu_kv_cache_gb frees it)")
        return ", ".join(parts)

    def _warm_up_peak(self) -> int:
        """Peak bytes of a forward pass over max_num_batched_tokens, beyond the KV it used."""
        warm_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        warm_blocks = -(-warm_tokens // self.block_size)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.kv_cache = PagedKVCache(self.kv_shape[0], warm_blocks, *self.kv_shape[1:], self.dtype, self.device)
        with torch.inference_mode():
            meta = self.backend.build_metadata([warm_tokens], [warm_tokens], [list(range(warm_blocks))],
                                               list(range(warm_tokens)), self.block_size, self.device)
            ids = torch.arange(warm_tokens, device=self.device) % self.model.config.vocab_size
            hidden = self.model(ids, torch.arange(warm_tokens, device=self.device), DeviceKV(self.kv_cache, self.backend, meta))
            self.model.compute_logits(hidden[-1:])
        peak = torch.cuda.max_memory_allocated(self.device) - self.kv_cache.data.numel() * self.kv_cache.data.element_size()
        del self.kv_cache
        torch.cuda.empty_cache()
        return peak

    def _capture_graphs(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return None
        buckets = batch_buckets(min(self.config.max_num_seqs, 512))
        max_blocks = self.config.num_blocks_per_seq_limit
        narrowed = [b for b in buckets if b <= self.narrowed.graph_rows(max_blocks)] if self.narrowed.enabled else []
        if narrowed:
            self.narrowed.capturing()
        return DecodeGraphs(self.model, self._graph_kv, buckets, max_blocks, self.block_size, self.num_blocks,
                            self.device, self.last_tokens, self.staged, narrowed)

    def _graph_kv(self, meta: AttentionMetadata, mode: str) -> KVAccess:
        if mode == "narrowed":
            return self.narrowed.kv(meta)
        return StagedKV(self.kv_cache, self.backend, meta, self.staged) if mode == "staged" else \
            DeviceKV(self.kv_cache, self.backend, meta)

    # ---- steps ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """One forward pass and sampling, waiting for the tokens (with logprobs where asked)."""
        logits, prompt_logprobs, stats = self._timed_logits(plan)
        if not self.tp.is_driver:
            return StepOutput({}, prompt_logprobs, resolved(stats))
        if logits is None:  # no tokens to wait for: a count still on the device stays deferred
            return StepOutput({}, prompt_logprobs, stats)
        generators = [self._generator(i, p) for i, p in zip(plan.sample_seq_ids, plan.sample_params)]
        out = sample(logits, plan.sample_params, generators, self.default_generator, plan.sample_history)
        return StepOutput({i: (t, lp) for i, t, lp in zip(plan.sample_seq_ids, out.token_ids, out.logprobs)},
                          prompt_logprobs, resolved(stats))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> tuple[torch.Tensor | None, StepStats]:
        """Like execute() without logprobs, but nothing waits for the device: returns the sampled tokens
        on the device, also kept in last_tokens as the next step's inputs for placeholder ids, and the
        step's work (deferred where the device counts it)."""
        logits, _, stats = self._timed_logits(plan)
        if logits is None:
            return None, stats
        if self.tp.is_driver:
            generators = [self._generator(i, p) for i, p in zip(plan.sample_seq_ids, plan.sample_params)]
            tokens = sample_on_device(logits, plan.sample_params, generators, self.default_generator,
                                      plan.sample_history)
        if self.tp.size > 1:
            tokens = broadcast_from_driver(tokens if self.tp.is_driver else
                                           torch.empty(len(plan.sample_rows), dtype=torch.int64, device=self.device))
        self.last_tokens[: len(tokens)].copy_(tokens)
        return tokens, stats

    def set_block_selector(self, selector: BlockSelector) -> None:
        """The narrowed decode graphs keep the selector they were captured with: another one narrows eagerly
        (until recapture_graphs)."""
        self.selector = selector
        self.narrowed.selector = selector

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again, the narrowed ones with the current selector and its budget."""
        if self.graphs is not None:
            self.graphs = None
            torch.cuda.empty_cache()
            self.graphs = self._capture_graphs()

    def _timed_logits(self, plan: StepPlan) -> tuple[torch.Tensor | None, dict[int, list], StepStats]:
        start = time.perf_counter()
        try:
            return self._logits(plan)
        finally:
            self.forward_seconds[plan.kind] += time.perf_counter() - start

    def _logits(self, plan: StepPlan) -> tuple[torch.Tensor | None, dict[int, list], StepStats]:
        """The forward pass: logits of the sampling rows (None when no sequence samples this step), the
        prompt logprobs and the step's attention work per sequence."""
        for seq_id in plan.released:
            self.generators.pop(seq_id, None)
        if plan.offloads:
            self.kv_cache.moved_to_host(plan.offloads)
        self.selector.before_step(plan)
        if plan.narrowed:
            logits = self._narrowed_logits(plan)
            per_block = self.narrowed.columns_per_block
            return logits, {}, DeferredStats(self.narrowed.counts[: len(plan.seq_ids)],
                                             lambda counts: self.work.narrowed(plan, counts, per_block))
        if plan.graph_batch is not None:
            tables, mode = plan.block_tables, "plain"
            if plan.staged_copies is not None:
                self.staged.set_step(plan.staged_copies, plan.offloads)
                tables, mode = ring_tables(plan.block_tables, plan.on_host), "staged" if plan.staged_copies else "plain"
            logits = self.graphs.run(plan.input_ids, plan.positions, plan.slots, tables, plan.graph_batch, mode)
            return logits, {}, self.work.fixed(plan, self.selector.dense)
        as_tensor = lambda x: list_to_device(x, torch.int64, self.device)  # noqa: E731
        selector = self._step_selector(plan)
        sparse = None if selector.dense else SparseStats(len(plan.seq_lens))
        kv = self._kv_access(plan, selector, sparse)
        ids = resolve_placeholders(as_tensor(plan.input_ids), self.last_tokens)
        hidden = self.model(ids, as_tensor(plan.positions), kv)
        prompt_logprobs = self._prompt_logprobs(hidden, plan)
        if sparse is None:
            stats = self.work.fixed(plan, self.selector.dense)
        else:  # counted on the device: read after the step's tokens, or with the next step (no sync here)
            counts = sparse.device_counts()
            stats = DeferredStats(torch.cat(counts), lambda values: self._sparse_work(plan, sparse, iter(values))) \
                if counts else self._sparse_work(plan, sparse, iter(()))
        if not plan.sample_rows:
            return None, prompt_logprobs, stats
        return self.model.compute_logits(hidden[as_tensor(plan.sample_rows)]), prompt_logprobs, stats

    def _sparse_work(self, plan: StepPlan, sparse: SparseStats, values: Iterator[int]) -> dict[int, SeqStepStats]:
        """A sparse step's work from its counts (values: those counted on the device, on the host now)."""
        if in_place := sparse.resolve(values):
            self.host_pool.stats.h2d_bytes += in_place  # host KV the decode kernel read where it lies
        if plan.staged_copies is not None:  # a staged step is dense: every host block copied
            return self.work.fixed(plan, self.selector.dense)
        return self.work.sparse(plan, sparse)

    def _narrowed_logits(self, plan: StepPlan) -> torch.Tensor:
        """A decode step every row of which the selector narrows alike: in its graph when the graph was
        captured with this selector, else the same KV access eagerly."""
        if plan.offloads:
            self.host_pool.copy_out_now(plan.offloads)
        tables = self.narrowed.tables(plan.block_tables, plan.on_host)
        if self.graphs is not None and self.narrowed.captured(self.selector, plan.graph_batch, self.graphs):
            return self.graphs.run(plan.input_ids, plan.positions, plan.slots, tables, plan.graph_batch, "narrowed")
        n = len(plan.input_ids)
        meta = self.backend.build_metadata([1] * n, plan.seq_lens, tables, plan.slots, self.block_size, self.device)
        as_tensor = lambda x: list_to_device(x, torch.int64, self.device)  # noqa: E731
        ids = resolve_placeholders(as_tensor(plan.input_ids), self.last_tokens)
        return self.model.compute_logits(self.model(ids, as_tensor(plan.positions), self.narrowed.kv(meta)))

    def _step_selector(self, plan: StepPlan) -> BlockSelector:
        """A dense selector for a step the selector leaves dense (the same work as sparse_policy "full"),
        except where offload's split path would then copy the host blocks of the layers the pool mirrors."""
        if self.selector.dense or not self.selector.dense_for_step(self.block_size, plan.query_lens, plan.seq_lens):
            return self.selector
        mirrored = self.host_pool is not None and self.host_pool.mirrored_layers > 0
        if mirrored and (plan.has_host_blocks or plan.offloads) and plan.staged_copies is None:
            return self.selector
        return DENSE

    def _kv_access(self, plan: StepPlan, selector: BlockSelector, stats: SparseStats | None) -> KVAccess:
        def meta(tables: list[list[int]]) -> AttentionMetadata:
            return self.backend.build_metadata(plan.query_lens, plan.seq_lens, tables, plan.slots, self.block_size,
                                               self.device)

        if self.host_pool is None or not (plan.has_host_blocks or plan.offloads or plan.staged_copies):
            if plan.staged_copies is not None:  # [] : nothing to stage, but the moves are due
                self.staged.set_step([], plan.offloads)
            return DeviceKV(self.kv_cache, self.backend, meta(plan.block_tables), selector, stats, plan.prefill_ends)
        if plan.staged_copies is not None:
            self.staged.set_step(plan.staged_copies, plan.offloads)
            return StagedKV(self.kv_cache, self.backend, meta(ring_tables(plan.block_tables, plan.on_host)), self.staged)
        slots = list_to_device(plan.slots, torch.int64, self.device)
        kv = offload_kv_access(self.host_pool, self.kv_cache, self.backend, plan, slots, selector, stats)
        kv.begin()
        return kv

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan, rows_per_chunk: int = 1024) -> dict[int, list]:
        result = {}
        for req in plan.prompt_logprobs:
            entries = []
            for lo in range(0, len(req.targets), rows_per_chunk):
                hi = min(lo + rows_per_chunk, len(req.targets))
                logits = self.model.compute_logits(hidden[req.row + lo : req.row + hi])
                if self.tp.is_driver:  # other ranks hold a slice of the vocabulary
                    entries.extend(logprob_entries(logits, req.targets[lo:hi], req.top_n))
            result[req.seq_id] = entries
        return result

    def _generator(self, seq_id: int, params) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        if seq_id not in self.generators:
            self.generators[seq_id] = torch.Generator(self.device).manual_seed(params.seed)
        return self.generators[seq_id]
