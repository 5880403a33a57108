"""Where the host's time goes in the throughput workload's steps, by batch (no profiler): the engine's methods
wrapped with perf_counter, the workload run as bench/throughput.py runs it (async scheduling). A probe.

    cd bench && PYTHONPATH=..:. python3 ../docs/results/fortyfirst/host_split.py
"""
import collections
import time

import torch

import throughput
from common import log, require_cuda
from nanovllm import LLM, SamplingParams
from nanovllm.engine import model_runner, worker as worker_module

BUCKETS = ((193, 256), (129, 192), (65, 128), (17, 64), (1, 16))
totals = collections.defaultdict(float)
current = {"batch": 0}


def bucket() -> str:
    b = current["batch"]
    return next((f"{lo}-{hi}" for lo, hi in BUCKETS if lo <= b <= hi), "0")


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[(bucket(), name)] += time.perf_counter() - start
    return wrapper


def main():
    require_cuda()
    llm = LLM(str(throughput.HERE / "configs" / "qwen3-0.6b"), load_format="dummy", max_model_len=2064,
              async_scheduling=True)
    vocab = llm.config.hf_config["vocab_size"]
    prompts, out_lens = throughput.workload(256, 100, 1024, vocab)
    warm, _ = throughput.workload(64, 100, 1024, vocab, seed=1)
    llm.generate(warm, SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True), use_tqdm=False)

    plan = llm.runner.planner.plan

    def plan_and_note(scheduled, *args, **kwargs):
        current["batch"] = len(scheduled)
        totals[(bucket(), "steps")] += 1
        return plan(scheduled, *args, **kwargs)
    llm.runner.planner.plan = timed("plan", plan_and_note)
    llm.scheduler.schedule = timed("schedule", llm.scheduler.schedule)
    llm.runner.worker.launch = timed("worker.launch", llm.runner.worker.launch)
    llm.runner.worker._timed_logits = timed("forward (graph run)", llm.runner.worker._timed_logits)
    worker_module.sample_on_device = timed("sample_on_device", worker_module.sample_on_device)
    model_runner.PendingTokens.__init__ = timed("PendingTokens copy", model_runner.PendingTokens.__init__)
    model_runner.PendingTokens.tolist = timed("tokens wait (tolist)", model_runner.PendingTokens.tolist)
    llm._resolve_pending = timed("resolve_pending", llm._resolve_pending)
    llm._step = timed("step", llm._step)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    log(f"run {time.perf_counter() - start:.2f} s")
    names = ["step", "schedule", "plan", "worker.launch", "forward (graph run)", "sample_on_device",
             "PendingTokens copy", "resolve_pending", "tokens wait (tolist)"]
    for lo, hi in BUCKETS:
        b = f"{lo}-{hi}"
        n = totals[(b, "steps")]
        if n:
            log(f"batch {b:>7s}: {int(n):4d} steps; ms a step: " +
                ", ".join(f"{name} {1e3 * totals[(b, name)] / n:.2f}" for name in names))


if __name__ == "__main__":
    main()
