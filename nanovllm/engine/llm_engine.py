"""The engine core: admission, one scheduling loop step at a time, detokenization and stop checks.

`step()` is the whole loop body, so an offline `generate()` and an online server drive the same code.

With async_scheduling, a step launches its forward pass and sampling without waiting for them, then
processes the previous step's tokens while the device works: sampled tokens feed the next step on
the device, and each sampling sequence carries a PLACEHOLDER until its token reaches the host. A
sequence that stops (EOS, stop string) has then already been scheduled once more; that token is
dropped. Steps with a request that wants logprobs or prompt logprobs, or whose sampling depends on
its earlier tokens (repetition, presence or frequency penalty), run synchronously.

A request with n > 1 holds n sequences (samples). The first is queued at once; the others are queued
when the first has computed the prompt (its first token) and start from its prompt KV blocks, shared
through the block manager's reference counts (`Scheduler._cached_prefix`); each computes only the
prompt's last partial block. Sample i draws with seed + i when the request is seeded.

A step that raises fails only its batch: the requests holding KV or a token in flight are aborted and
`StepFailed` names them; waiting requests go on with the next step. A failed tensor-parallel rank
(`TensorParallelError`) is raised as it is after that abort: the group is stopped, no later step can run.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanovllm import request_log, validation
from nanovllm.config import EngineConfig
from nanovllm.engine import gc_watch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.distributed.executor import TensorParallelError
from nanovllm.engine.detokenizer import OutputText
from nanovllm.engine.model_files import eos_token_ids, generation_defaults, load_tokenizer
from nanovllm.engine.model_runner import ModelRunner, PendingTokens
from nanovllm.engine.request_state import RequestState, SampleState, sample_params
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.kernels.compile_watch import WATCH
from nanovllm.models.hub import resolve_model
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    gpu_blocks_used: int  # KV blocks of the device pool in use
    gpu_blocks_total: int
    host_blocks_used: int  # KV blocks of the host (offload) pool in use; 0 of 0 without offload
    host_blocks_total: int
    num_preemptions: int
    steps: tuple[int, int, int] = (0, 0, 0)  # steps run so far by kind, STEP_KINDS' order (engine/step_plan.py)
    step_seconds: float = 0.0  # wall time spent in step() so far: with the run's length, how busy the loop kept it
    gc_seconds: float = 0.0  # wall time this process spent in cyclic garbage collections (gc_watch.watch(): else 0)
    # host seconds in the steps' forward passes by kind: with CUDA, launching their kernels or replaying their graph
    # (where it exceeds the device's time, the step is bound by the host)
    forward_seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)


class StepFailed(RuntimeError):
    """step() raised; the requests of its batch were aborted (request_ids) and the engine can go on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"a step failed with {cause!r}; its {len(request_ids)} request(s) were aborted")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, model: str | None = None, **options):
        if model is None:
            from nanovllm.models.fetch import default_model_path

            model = str(default_model_path())
        path = resolve_model(model, options.get("revision"), options.get("download_dir"))
        self.config = EngineConfig.from_options(model, str(path), **options)
        model_dir = Path(self.config.model_path)
        self.tokenizer = load_tokenizer(model_dir)
        watching = self.config.device != "cpu" and torch.cuda.is_available() and WATCH.install()
        if watching:
            WATCH.starting()
        started = time.perf_counter()
        self.runner = ModelRunner(self.config, None if self.config.load_format == "dummy" else model_dir)
        self.startup_seconds = time.perf_counter() - started  # weights, KV pool, warm-up, kernels, CUDA graphs
        if watching:
            WATCH.serving()
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.kvcache_block_size,
                                          self.config.enable_prefix_caching, self.runner.num_host_blocks)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.eos_token_ids = eos_token_ids(model_dir, self.config.hf_config, self.tokenizer)
        self._log_kv_pool()
        logger.info("engine ready: start-up (weights, KV pool, warm-up, kernels, CUDA graphs) took %.1f s",
                    self.startup_seconds)
        self.requests: dict[str, RequestState] = {}
        self._by_seq_id: dict[int, tuple[RequestState, SampleState]] = {}
        self._ids = itertools.count()
        self._pending: tuple[PendingTokens, list[int]] | None = None  # async: launched tokens, their indices
        self._step_seconds = 0.0
        self.generation_defaults = generation_defaults(model_dir) if self.config.generation_config == "auto" else {}
        if self.generation_defaults:
            logger.info("sampling defaults from %s: %s", model_dir / "generation_config.json", self.generation_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (generation_config="auto"), as
        vLLM: used when a request comes without params."""
        return SamplingParams(**self.generation_defaults)

    def _log_kv_pool(self) -> None:
        bm, max_len = self.block_manager, self.config.max_model_len
        gib = self.runner.bytes_per_block / 2**30
        per_seq = bm.blocks_for_tokens(max_len)
        logger.info("KV cache on %s: %d device blocks (%.2f GiB) + %d host blocks (%.2f GiB) of %d tokens; "
                    "max concurrent sequences at max_model_len=%d: %.2f on the device, %.2f with the host pool",
                    self.runner.device, bm.num_blocks, bm.num_blocks * gib, bm.num_host_blocks,
                    bm.num_host_blocks * gib, bm.block_size, max_len, bm.num_blocks / per_seq,
                    (bm.num_blocks + bm.num_host_blocks) / per_seq)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (with tensor_parallel_size > 1; also done at interpreter
        exit and when the engine is garbage-collected). The engine cannot run steps afterwards."""
        self.runner.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a str, or token ids); TypeError for any other type. Thread-safe."""
        prompt = validation.prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            return self.tokenizer(prompt).input_ids
        return prompt

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Refuse, with the numbers, any request that could never complete or could fail a step."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # again: fields may have been changed since construction
        n, limit = len(token_ids), self.config.max_model_len
        vocab = self.config.hf_config["vocab_size"]
        if n == 0:
            raise ValueError("prompt is empty: at least one token is required")
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}) (the model's vocab_size)")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name}={getattr(params, name)} exceeds the model's vocab_size={vocab}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                             f"[0, {vocab}) (the model's vocab_size)")
        if params.n > 1 and params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if n + 1 > limit:
            raise ValueError(f"prompt has {n} tokens; with one generated token that exceeds max_model_len={limit}")
        kv_tokens = min(n + params.max_tokens, limit) - 1
        bm = self.block_manager
        blocks = bm.blocks_for_tokens(kv_tokens)
        if blocks > bm.num_blocks + bm.num_host_blocks:
            pools = f"{bm.num_blocks} device + {bm.num_host_blocks} host blocks" if bm.num_host_blocks else \
                f"{bm.num_blocks} blocks"
            raise ValueError(f"request needs {blocks} KV blocks ({kv_tokens} tokens of KV at block size "
                             f"{bm.block_size}) but the whole pool has {pools}")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, detokenize: bool = True) -> str:
        """Queue a request; returns its id. detokenize=False: outputs carry token ids only (text "") and
        stop strings are not checked; the caller turns tokens into text (the server, off this thread)."""
        params = self.get_default_sampling_params() if params is None else params
        token_ids = self.tokenize(prompt)
        self.check_request(token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text = prompt if isinstance(prompt, str) else None
        req = RequestState(request_id, [], prompt_text, list(token_ids), frozenset(params.stop_token_ids), [])
        vocab = self.config.hf_config["vocab_size"]
        stop_ids = sorted(t for t in self.eos_token_ids | req.stop_token_ids if t < vocab)
        for index in range(params.n):
            first = req.samples[0].seq if req.samples else None
            seq = Sequence(token_ids, sample_params(params, index), self.config.kvcache_block_size, prompt_text, first)
            seq.min_tokens_stop_ids = stop_ids
            text = OutputText.for_params(self.tokenizer, token_ids, params) \
                if self.tokenizer is not None and detokenize else None
            req.samples.append(SampleState(index, seq, text))
            self._by_seq_id[seq.seq_id] = (req, req.samples[-1])
        req.unqueued = [sample.seq for sample in req.samples[1:]]
        self.requests[request_id] = req
        self.scheduler.add(req.seq)
        request_log.log_request(request_id, len(token_ids), params)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for sample in req.samples:
            seq = sample.seq
            self._by_seq_id.pop(seq.seq_id, None)
            if seq in req.unqueued:
                seq.finish("abort")
            elif not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.runner.release(seq)
        req.unqueued = []

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """A snapshot for monitoring (the server's /metrics)."""
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_used_blocks,
                           bm.num_blocks, bm.num_used_host_blocks, bm.num_host_blocks, self.scheduler.num_preemptions,
                           tuple(self.runner.planner.steps), self._step_seconds, gc_watch.seconds(),
                           tuple(self.runner.worker.forward_seconds))

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and return the requests that got a new token."""
        return [req.output() for req in self._step(final_only=False)]

    def step_states(self) -> list[RequestState]:
        """step(), returning the requests' own states instead of outputs built from them: for a caller that
        reads their sequences at once (the server's engine process sends token deltas), building a
        RequestOutput per running request per step was a fifth of its time (py-spy, H200)."""
        return self._step(final_only=False)

    def admitted_seq_ids(self) -> list[int]:
        """The sequences the latest step took from the waiting queue (a first admission, or one after a
        preemption): with the engine's FIFO queue, what a caller timing the queue reads instead of scanning
        every waiting request per step."""
        return [seq.seq_id for seq in self.scheduler.admitted]

    def _step(self, final_only: bool) -> list[RequestState]:
        """The requests that got a token in this step, each once; final_only only those that finished (offline
        generate). Raises StepFailed after aborting a failed step's batch."""
        started = time.perf_counter()
        try:
            touched = self._run_step(final_only)
        except TensorParallelError:
            self._abort_failed_batch()
            raise
        except Exception as e:
            raise StepFailed(self._abort_failed_batch(), e) from e
        finally:
            self._step_seconds += time.perf_counter() - started
        return list({id(req): req for req in touched}.values()) if len(touched) > 1 else touched

    def _abort_failed_batch(self) -> list[str]:
        """Abort the requests a failed step may have left half-done: those holding KV blocks (the batch)
        and those with a token in flight; returns their ids. The KV bookkeeping must then be whole."""
        seqs = list(self.scheduler.running)
        if self._pending is not None:
            seqs += self._pending[0].seqs
            self._pending = None
        failed = list(dict.fromkeys(self._by_seq_id[s.seq_id][0].request_id for s in seqs if s.seq_id in self._by_seq_id))
        for request_id in failed:
            self.abort_request(request_id)
        self.block_manager.check_invariants([s.seq for req in self.requests.values() for s in req.samples])
        return failed

    def _run_step(self, final_only: bool) -> list[RequestState]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self._pending is not None:
                return self._resolve_pending(final_only)
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are pending")
            return []
        offloads = self.block_manager.take_pending_offloads()
        if self.config.async_scheduling and not any(item.seq.synchronous_sampling for item in scheduled):
            return self._launch(scheduled, offloads, final_only)
        touched = []
        if self._pending is not None:
            touched = self._resolve_pending(final_only)
            scheduled = [item for item in scheduled if not item.seq.is_finished]  # stopped by that token
        sampled = self.runner.run(scheduled, offloads)
        self.scheduler.mark_computed(scheduled)
        for seq_id, (token, logprobs) in sampled.items():
            req, sample = self._by_seq_id[seq_id]
            sample.seq.append_token(token)
            self._after_token(req, sample, token, logprobs, final_only, touched)
        return touched

    def _launch(self, scheduled, offloads, final_only: bool) -> list[RequestState]:
        """Async: enqueue this step, then process the previous one's tokens while the device runs."""
        pending = self.runner.launch(scheduled, offloads)
        self.scheduler.mark_computed([item for item in scheduled if not item.samples])
        self.scheduler.mark_computed([item for item in scheduled if item.samples], register=False)
        indices = []
        for seq in pending.seqs:
            indices.append(len(seq))
            seq.token_ids.append(PLACEHOLDER)
        touched = self._resolve_pending(final_only) if self._pending is not None else []
        if not all(seq.is_finished for seq in pending.seqs):  # else every token of it would be dropped
            self._pending = (pending, indices)
        else:
            pending.record_work()
        return touched

    def _resolve_pending(self, final_only: bool) -> list[RequestState]:
        """Put the launched step's tokens in place of their placeholders, then stop checks as usual."""
        (pending, indices), self._pending = self._pending, None
        touched: list[RequestState] = []
        tokens = pending.tolist()
        pending.record_work()  # before the tokens: a request they finish reports this step's work too
        for seq, index, token in zip(pending.seqs, indices, tokens):
            found = self._by_seq_id.get(seq.seq_id)
            if found is None or seq.is_finished:  # aborted, or stopped by the previous token
                continue
            seq.set_token(index, token)
            self.block_manager.register_computed_blocks(seq)
            self._after_token(*found, token, None, final_only, touched, num_tokens=index + 1)
        return touched

    def _after_token(self, req: RequestState, sample: SampleState, token: int, logprobs: dict[int, float] | None,
                     final_only: bool, touched: list[RequestState], num_tokens: int | None = None) -> None:
        """Bookkeeping of a token that is in place at position num_tokens - 1 (default: the last)."""
        seq = sample.seq
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if sample.text is not None:
            sample.text.add(token)
        if req.unqueued and sample.index == 0:  # the prompt's KV is computed: the other samples can share it
            self.scheduler.add_forks(req.unqueued)
            req.unqueued = []
        reason = req.stop_reason(sample, token, num_tokens or len(seq), self.eos_token_ids, self.config.max_model_len)
        if reason:
            del seq.token_ids[num_tokens or len(seq):]  # a placeholder launched after it (async)
            self.scheduler.finish(seq, reason)
        if not final_only or req.finished:
            touched.append(req)
        if seq.is_finished:
            del self._by_seq_id[seq.seq_id]
            self.runner.release(seq)
        if req.finished:
            del self.requests[req.request_id]
