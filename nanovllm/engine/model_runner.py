"""Turns a scheduled step into tensors, runs the model over the paged cache and samples."""
from __future__ import annotations

from pathlib import Path

import torch

from nanovllm.config import EngineConfig
from nanovllm.engine.cuda_graph import DecodeGraphs, resolve_placeholders
from nanovllm.engine.block_manager import HOST_BASE, is_host_block
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine import offload
from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.layers.attention import AttentionMetadata, get_attention_backend
from nanovllm.layers.fused_ops import get_layer_ops
from nanovllm.layers.sampler import SamplerOutput, logprob_entries, sample, sample_on_device
from nanovllm.models.loader import build_model

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available on this machine")
    return torch.device(name)


def resolve_backend(name: str, device: torch.device) -> str:
    """'auto': Triton kernels on CUDA when Triton is installed, else the pure-PyTorch path."""
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            pass
    return "torch"


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and less accurate
    stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return torch.float16 if stored == "float16" else torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path | None):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, config.hf_config, self.device)
        self.block_size = config.kvcache_block_size
        self.backend = get_attention_backend(resolve_backend(config.attention_backend, self.device))
        layer_ops = get_layer_ops("triton" if self.backend.name == "triton" else "torch")
        self.model = build_model(config.hf_config, self.backend, self.dtype, self.device, model_dir, config.seed,
                                 layer_ops)
        mc = self.model.config
        self.kv_shape = (mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.num_blocks = config.num_gpu_blocks or self._blocks_that_fit()
        # One extra block past the pool: a scratch target for padded rows; the block manager never hands it out.
        self.kv_cache = PagedKVCache(mc.num_layers, self.num_blocks + 1, self.block_size, mc.num_kv_heads,
                                     mc.head_dim, self.dtype, self.device)
        self.offloader = self._make_offloader() if config.enable_cpu_offload else None
        self.num_host_blocks = self.offloader.host.shape[2] if self.offloader else 0
        self.default_generator = torch.Generator(self.device).manual_seed(config.seed)
        # The last launch()'s sampled tokens, on the device, and each sampling sequence's row in them.
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self._last_rows: dict[int, int] = {}
        self.graphs = self._capture_graphs()

    def _capture_graphs(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return None
        return DecodeGraphs(self.model, self.backend, self.kv_cache, min(self.config.max_num_seqs, 512),
                            self.config.num_blocks_per_seq_limit, self.block_size, self.num_blocks, self.device,
                            self.last_tokens, self.offloader.staged if self.offloader and self.offloader.staged_decode
                            else None)

    def _make_offloader(self) -> offload.KVOffloader:
        host_blocks = int(self.config.cpu_kv_cache_gb * 2**30 // self.bytes_per_block)
        if host_blocks < 1:
            raise ValueError(f"cpu_kv_cache_gb={self.config.cpu_kv_cache_gb} holds no KV block "
                             f"({self.bytes_per_block} bytes each)")
        return offload.KVOffloader(self.kv_cache, host_blocks, self._ring_blocks())

    def _ring_blocks(self) -> int:
        """Blocks per ring slot: RING_SLOT_BYTES of one layer's KV."""
        return max(1, offload.RING_SLOT_BYTES // (self.bytes_per_block // self.kv_shape[0]))

    @property
    def bytes_per_block(self) -> int:
        layers, block_size, heads, head_dim = self.kv_shape
        return PagedKVCache.bytes_per_block(layers, block_size, heads, head_dim, self.dtype)

    def _blocks_that_fit(self) -> int:
        if self.device.type == "cpu":
            budget = self.config.cpu_kv_cache_gb * 2**30
        else:
            budget = self._cuda_kv_budget()
            if self.config.enable_cpu_offload:  # the ring of staging slots comes out of the same budget
                budget -= offload.RING_SLOTS * self._ring_blocks() * self.bytes_per_block // self.kv_shape[0]
        blocks = int(budget // self.bytes_per_block)
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache: one block needs {self.bytes_per_block} bytes, budget is {int(budget)}"
            )
        return blocks

    def _cuda_kv_budget(self) -> int:
        """gpu_memory_utilization of the card, minus weights, other processes and the peak activations
        of a warm-up step of max_num_batched_tokens."""
        free, total = torch.cuda.mem_get_info(self.device)
        other_processes = (total - free) - torch.cuda.memory_reserved(self.device)
        warm_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        warm_blocks = -(-warm_tokens // self.block_size)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.kv_cache = PagedKVCache(self.kv_shape[0], warm_blocks, *self.kv_shape[1:], self.dtype, self.device)
        self._forward_tokens(list(range(warm_tokens)), list(range(warm_blocks)))
        peak = torch.cuda.max_memory_allocated(self.device) - self.kv_cache.data.numel() * self.kv_cache.data.element_size()
        del self.kv_cache
        torch.cuda.empty_cache()
        return int(total * self.config.gpu_memory_utilization - peak - other_processes)

    @torch.inference_mode()
    def _forward_tokens(self, token_ids: list[int], block_table: list[int]) -> None:
        n = len(token_ids)
        meta = self.backend.build_metadata([n], [n], [block_table], list(range(n)), self.block_size, self.device)
        ids = torch.tensor(token_ids, device=self.device) % self.model.config.vocab_size
        hidden = self.model(ids, torch.arange(n, device=self.device), self.kv_cache, meta)
        self.model.compute_logits(hidden[-1:])

    def _prepare(self, scheduled: list[ScheduledSeq], offloads: list[tuple[int, int]] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables, sample_rows = [], [], [], []
        bs = self.block_size
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            ids.extend(seq.token_ids[start : start + n])
            if ids[-1] == PLACEHOLDER:  # only ever a sequence's last token
                ids[-1] = self._input_id(seq, PLACEHOLDER)
            positions.extend(range(start, start + n))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            if item.samples:
                sample_rows.append(len(ids) - 1)
        if self.offloader is None:
            meta = self.backend.build_metadata(query_lens, seq_lens, tables, slots, bs, self.device)
        else:
            meta = self._offload_metadata(query_lens, seq_lens, tables, slots, list(offloads))
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        return resolve_placeholders(as_tensor(ids), self.last_tokens), as_tensor(positions), meta, sample_rows

    def _offload_metadata(self, query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                          slots: list[int], offloads: list[tuple[int, int]]) -> AttentionMetadata:
        """Decode steps with few host blocks: staged into a ring slot (StagedDecode). Other steps: device
        blocks in compacted tables for the causal part, host blocks in the step's OffloadStep. Host
        blocks are full and precede every new token, so dropping them keeps the causal mask right."""
        staged = self._stage_decode(query_lens, tables, offloads)
        if staged is not None:
            meta = self.backend.build_metadata(query_lens, seq_lens, staged, slots, self.block_size, self.device)
            meta.offload = self.offloader.staged
            return meta
        located = [[(True, b - HOST_BASE) if is_host_block(b) else (False, b) for b in t[: -(-n // self.block_size)]]
                   for t, n in zip(tables, seq_lens)]
        device_tables = [[b for on_host, b in t if not on_host] for t in located]
        num_host = [sum(on_host for on_host, _ in t) for t in located]
        compact_lens = [n - h * self.block_size for n, h in zip(seq_lens, num_host)]
        meta = self.backend.build_metadata(query_lens, compact_lens, device_tables, slots, self.block_size, self.device)
        if offloads or any(num_host):
            meta.offload = self.offloader.plan_step(self.backend, query_lens, seq_lens, located, offloads)
        return meta

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], offloads: list[tuple[int, int]] = ()
            ) -> dict[int, tuple[int, dict[int, float] | None]]:
        """One forward pass; returns {seq_id: (sampled token, logprobs)} for sequences that sample.
        offloads: (device block, host block) pairs the block manager moved out since the last step."""
        sampling = [item.seq for item in scheduled if item.samples]
        logits = self._logits(scheduled, offloads, sampling)
        if logits is None:
            return {}
        out: SamplerOutput = sample(
            logits, [s.params for s in sampling], [self._generator(s) for s in sampling], self.default_generator
        )
        return {s.seq_id: (t, lp) for s, t, lp in zip(sampling, out.token_ids, out.logprobs)}

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], offloads: list[tuple[int, int]] = ()) -> PendingTokens:
        """Like run() without logprobs, but nothing waits for the device: the sampled tokens stay there
        (also as the next step's inputs where a sequence's last token is a PLACEHOLDER) and are copied
        to the host in the background."""
        sampling = [item.seq for item in scheduled if item.samples]
        logits = self._logits(scheduled, offloads, sampling)
        if logits is None:
            return PendingTokens([], None)
        tokens = sample_on_device(logits, [s.params for s in sampling], [self._generator(s) for s in sampling],
                                  self.default_generator)
        self.last_tokens[: len(sampling)].copy_(tokens)
        self._last_rows = {s.seq_id: i for i, s in enumerate(sampling)}
        return PendingTokens(sampling, tokens)

    def _logits(self, scheduled: list[ScheduledSeq], offloads, sampling: list[Sequence]) -> torch.Tensor | None:
        """The forward pass: logits of the sampling rows (None when no sequence samples this step)."""
        if self._graph_fits(scheduled, offloads):
            tables = [s.block_table for s in sampling]
            if self.offloader is not None:  # None: host blocks in more runs than the graphs have copies
                tables = self.offloader.staged.prepare(tables, list(offloads))
            if tables is not None:
                return self._decode_with_graph(sampling, tables, self.offloader is not None
                                               and bool(self.offloader.staged.pieces))
        ids, positions, meta, rows = self._prepare(scheduled, offloads)
        if meta.offload is not None:
            meta.offload.begin()
        hidden = self.model(ids, positions, self.kv_cache, meta)
        self._prompt_logprobs(hidden, scheduled)
        if not sampling:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows).to(self.device, non_blocking=True)])

    def _input_id(self, seq: Sequence, token: int) -> int:
        """A token id, or for a PLACEHOLDER -(row + 1): its row in last_tokens (resolved on the device)."""
        return token if token != PLACEHOLDER else -1 - self._last_rows[seq.seq_id]

    def _prompt_logprobs(self, hidden: torch.Tensor, scheduled: list[ScheduledSeq], rows_per_chunk: int = 1024) -> None:
        """Append, for requests that asked, the logprob of each prompt token this step's rows predict."""
        row = 0
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            end = min(start + n, seq.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
            if seq.params.prompt_logprobs is not None and end > start:
                for lo in range(start, end, rows_per_chunk):
                    hi = min(lo + rows_per_chunk, end)
                    logits = self.model.compute_logits(hidden[row + lo - start : row + hi - start])
                    seq.prompt_logprobs.extend(
                        logprob_entries(logits, seq.token_ids[lo + 1 : hi + 1], seq.params.prompt_logprobs))
            row += n

    def _graph_fits(self, scheduled: list[ScheduledSeq], offloads: list[tuple[int, int]]) -> bool:
        """A captured decode graph serves the step: all decodes, batch within the buckets, and at most
        staged_max_blocks host blocks (the graphs stage them)."""
        if self.graphs is None or not self._is_decode(scheduled) or not self.graphs.fits(len(scheduled)):
            return False
        if self.offloader is None:
            return True
        num_host = sum(is_host_block(b) for item in scheduled for b in item.seq.block_table)
        if self.offloader.staged_decode:
            return num_host <= self.offloader.staged_max_blocks
        return num_host == 0 and not offloads

    def _stage_decode(self, query_lens: list[int], tables: list[list[int]], offloads: list[tuple[int, int]]
                      ) -> list[list[int]] | None:
        """An eager decode step's tables renamed for StagedDecode, or None where it does not apply."""
        if not self.offloader.staged_decode or any(n != 1 for n in query_lens):
            return None
        return self.offloader.staged.prepare(tables, offloads)

    @staticmethod
    def _is_decode(scheduled: list[ScheduledSeq]) -> bool:
        return all(item.num_new_tokens == 1 and item.samples for item in scheduled)

    def _decode_with_graph(self, seqs: list[Sequence], tables: list[list[int]], staged: bool) -> torch.Tensor:
        positions = [len(s) - 1 for s in seqs]
        bs = self.block_size
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        ids = [s.token_ids[-1] for s in seqs]
        if PLACEHOLDER in ids:
            ids = [self._input_id(s, t) for s, t in zip(seqs, ids)]
        return self.graphs.run(ids, positions, slots, tables, staged)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return seq.generator


class PendingTokens:
    """Tokens sampled by a launched step, on their way to the host."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor | None):
        self.seqs = seqs
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
