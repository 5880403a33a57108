"""The engine's host work per decode step, with the device worker replaced by one that answers at once.

What a step costs on the host (scheduling, planning, token bookkeeping, stop checks; in the server's engine
process also the token deltas pickled and sent to the front end) sets the pace wherever it exceeds the GPU's
step: the throughput workload's tail (batch <= 64) and the server's engine process. Measured here on any
machine, per step, against the same engine offline (`step_states`) in the same process:

    python3 bench/host_step.py --batches 256 64 16 [--async-scheduling] [--profile]
    python3 bench/host_step.py --batches 256 --rounds 1 --prompt-len 256 --new-tokens 128 --step-kinds 1000
    python3 bench/host_step.py --batches 256 --rounds 0 --gc-requests 4000 [--gc-model DIR]

"offline" drives `LLMEngine.step_states()` as the server's engine process does without a front end; "server"
drives the engine process's own loop (`EngineLoop` over `_FrontEnds`), its events sent through a pipe to a
process that only reads them. Ratio = server / offline: the share of the engine process's step that is not the
engine's own.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import multiprocessing
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine import gc_watch  # noqa: E402
from nanovllm.engine.step_plan import STEP_KINDS, StepPlan  # noqa: E402
from nanovllm.engine.worker import StepOutput  # noqa: E402
from nanovllm.server.engine_core import _FrontEnds  # noqa: E402
from nanovllm.server.engine_loop import EngineLoop  # noqa: E402

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32, "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 4096, "num_attention_heads": 2,
        "num_hidden_layers": 1, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": True, "torch_dtype": "float32", "vocab_size": 151936}


class InstantWorker:
    """The device worker's execute/launch, answering with a token per sampling row and no device work.
    Tokens are drawn above every special id, so that only max_tokens ends a request."""

    def __init__(self, vocab_size: int, seed: int = 0):
        rng = random.Random(seed)
        self.pool = [rng.randrange(1000, vocab_size) for _ in range(4096)]  # drawn once: the harness costs ~nothing
        self.offset = 0
        self.forward_seconds = [0.0] * len(STEP_KINDS)  # no forward pass: no host time in one

    def _tokens(self, n: int) -> list[int]:
        self.offset = (self.offset + 1) % (len(self.pool) - n) if n < len(self.pool) else 0
        return self.pool[self.offset : self.offset + n]

    def execute(self, plan: StepPlan) -> StepOutput:
        tokens = self._tokens(len(plan.sample_seq_ids))
        return StepOutput({i: (t, None) for i, t in zip(plan.sample_seq_ids, tokens)}, {})

    def launch(self, plan: StepPlan) -> tuple[torch.Tensor | None, dict]:
        if not plan.sample_seq_ids:
            return None, {}
        return torch.tensor(self._tokens(len(plan.sample_seq_ids))), {}


def build_engine(model_dir: Path, batch: int, async_scheduling: bool, **options) -> LLM:
    options = {"max_num_batched_tokens": 8192, "num_gpu_blocks": batch * 40 + 64, **options}
    llm = LLM(str(model_dir), load_format="dummy", device="cpu", dtype="float32", max_model_len=2048,
              max_num_seqs=batch, kvcache_block_size=16, async_scheduling=async_scheduling, enforce_eager=True,
              **options)
    llm.runner.worker = InstantWorker(TINY["vocab_size"])
    return llm


def add_requests(llm: LLM, batch: int, prompt_len: int, new_tokens: int, tag: str) -> None:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    rng = random.Random(1)
    for i in range(batch):
        llm.add_request([rng.randrange(1000, 30000) for _ in range(prompt_len)], params, f"{tag}{i}")


def decode_step_times(llm: LLM, step) -> list[float]:
    """Seconds of each step after every request's prompt is in (all rows decode)."""
    times = []
    while llm.has_unfinished_requests():
        decoding = not llm.scheduler.waiting and all(s.num_computed_tokens >= s.num_prompt_tokens
                                                     for s in llm.scheduler.running)
        started = time.perf_counter()
        step()
        if decoding and llm.scheduler.running:
            times.append(time.perf_counter() - started)
    return times


def _drain(connection) -> None:
    """The front end's side: read every message until the engine says it stopped."""
    while True:
        batch = connection.recv()
        if any(event[0] == "stopped" for event in batch):
            return


def run_offline(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> list[float]:
    add_requests(llm, batch, prompt_len, new_tokens, "o")
    return decode_step_times(llm, llm.step_states)


def run_server(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> list[float]:
    """The engine process's loop body (commands, step, events out) with its events crossing a real pipe."""
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    reader = multiprocessing.get_context("fork").Process(target=_drain, args=(receive,), daemon=True)
    reader.start()
    front_ends = _FrontEnds([send])
    loop = EngineLoop(llm, front_ends, build_outputs=False)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    rng = random.Random(1)
    for i in range(batch):
        loop.post(front_ends.command(front_ends.sinks[0], ("add", f"s{i}", [rng.randrange(1000, 30000)
                                                                            for _ in range(prompt_len)], params)))

    def body() -> None:
        loop._next_commands()
        started = time.monotonic()
        outputs = loop._step()
        front_ends.stepped(outputs, loop._first_scheduled(), started, llm.stats())

    loop._next_commands()
    times = decode_step_times(llm, body)
    front_ends.stopped()
    reader.join(30)
    return times


def step_kinds(llm: LLM, num_requests: int, prompt_len: int, new_tokens: int) -> dict[str, int]:
    """Steps of `num_requests` requests added at once, by kind (the engine's count, `stats().steps`): decode rows
    only (what the decode CUDA graphs run), both (mixed: run eagerly), prefill rows only."""
    before = llm.stats().steps
    add_requests(llm, num_requests, prompt_len, new_tokens, "k")
    while llm.has_unfinished_requests():
        llm.step_states()
    return dict(zip(STEP_KINDS, (b - a for a, b in zip(before, llm.stats().steps))))


def gc_rounds(llm: LLM, requests: int, prompt_len: int, new_tokens: int, rounds: int) -> list[dict]:
    """The server loop over `requests` requests (max_num_seqs at a time), the heap as built and then frozen as the
    server's engine process freezes it (gc_watch.freeze_start_up_heap), alternating: every collection's time
    (gc_watch), the full ones apart, and the run's wall time."""
    gc_watch.watch()
    results = []
    for _ in range(rounds):
        for frozen in (False, True):
            if frozen:
                gc_watch.freeze_start_up_heap()
            before, full_before, started = gc_watch.seconds(), gc_watch.full_collections(), time.perf_counter()
            run_server(llm, requests, prompt_len, new_tokens)
            full, full_s = (after - was for after, was in zip(gc_watch.full_collections(), full_before))
            row = {"frozen": frozen, "wall_s": time.perf_counter() - started, "gc_s": gc_watch.seconds() - before,
                   "full_collections": full, "full_s": full_s}
            print(f"{requests} requests, heap {'frozen' if frozen else 'as built'}: run {row['wall_s']:.2f} s, "
                  f"collections {row['gc_s'] * 1e3:.0f} ms, of which {full} full {full_s * 1e3:.0f} ms", flush=True)
            results.append(row)
            if frozen:
                gc.unfreeze()
    return results


def summary(times: list[float]) -> dict:
    return {"steps": len(times), "median_us": statistics.median(times) * 1e6, "mean_us": statistics.fmean(times) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 64, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="offline and server alternate this many times")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile the last server run: top functions")
    parser.add_argument("--step-kinds", type=int, default=0, metavar="N",
                        help="also count the steps of N requests (--prompt-len in, --new-tokens out) added at once, "
                             "at max_num_seqs = the largest batch, by kind: decode only, prefill only, mixed")
    parser.add_argument("--gc-requests", type=int, default=0, metavar="N",
                        help="also run the server loop over N requests with the heap as built and frozen, alternating "
                             "--gc-rounds times: the garbage collector's time in each")
    parser.add_argument("--gc-rounds", type=int, default=3)
    parser.add_argument("--gc-model", type=Path, default=None,
                        help="a model to load beside the engine for --gc-requests, so that the heap holds what a real "
                             "engine's does (the tiny config's engine holds fewer objects)")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/nanovllm_host_step_model"))
    parser.add_argument("--out", type=Path, default=None, help="JSON of every run")
    args = parser.parse_args()
    args.model_dir.mkdir(parents=True, exist_ok=True)
    (args.model_dir / "config.json").write_text(json.dumps(TINY))
    results = []
    for batch in args.batches if args.rounds else []:  # --rounds 0: only the counts asked for below
        llm = build_engine(args.model_dir, batch, args.async_scheduling)
        run_offline(llm, batch, args.prompt_len, args.new_tokens)  # untimed: first-use costs
        rows = {"offline": [], "server": []}
        for _ in range(args.rounds):
            rows["offline"] += run_offline(llm, batch, args.prompt_len, args.new_tokens)
            rows["server"] += run_server(llm, batch, args.prompt_len, args.new_tokens)
        offline, server = summary(rows["offline"]), summary(rows["server"])
        ratio = server["median_us"] / offline["median_us"]
        print(f"batch {batch:4d}: offline {offline['median_us']:8.1f} us/step ({offline['median_us'] / batch:5.2f} per "
              f"row), server {server['median_us']:8.1f} us/step ({server['median_us'] / batch:5.2f} per row), "
              f"server/offline {ratio:.2f}x  [median of {offline['steps']} / {server['steps']} decode steps]",
              flush=True)
        results.append({"batch": batch, "async_scheduling": args.async_scheduling, "offline": offline,
                        "server": server, "ratio": ratio})
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run_server(llm, batch, args.prompt_len, args.new_tokens)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.step_kinds:
        llm = build_engine(args.model_dir, max(args.batches), args.async_scheduling)
        kinds = step_kinds(llm, args.step_kinds, args.prompt_len, args.new_tokens)
        print(f"{args.step_kinds} requests of {args.prompt_len} in / {args.new_tokens} out, max_num_seqs "
              f"{max(args.batches)}: {sum(kinds.values())} steps: " + ", ".join(f"{v} {k}" for k, v in kinds.items()))
        results.append({"step_kinds": kinds, "requests": args.step_kinds})
    if args.gc_requests:
        llm = build_engine(args.model_dir, max(args.batches), args.async_scheduling)
        real = LLM(str(args.gc_model), device="cpu", dtype="float32", max_model_len=2048) if args.gc_model else None
        beside = f" (with {args.gc_model.name})" if real else ""
        print(f"objects the collector tracks: {len(gc.get_objects())}{beside}")
        results.append({"gc": gc_rounds(llm, args.gc_requests, args.prompt_len, args.new_tokens, args.gc_rounds)})
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
