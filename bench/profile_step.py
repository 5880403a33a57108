"""Where a large-batch decode step's time goes: host (Python) work against GPU work.

Admits the throughput workload's prompts, prefills them, then times steady decode steps three ways:
the whole engine step; the captured CUDA graph replayed alone (its GPU time); the sampler alone on the
step's logits. The host share is what remains, and cProfile lists the Python functions it is spent in.

    PYTHONPATH=. python3 bench/profile_step.py [--config bench/configs/qwen3-0.6b] [--num-seqs 256] [--steps 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from common import HERE, cuda_ms, log, measure_hbm_bandwidth, require_cuda, save_results
from throughput import workload
from nanovllm import LLM, SamplingParams
from nanovllm.layers.sampler import sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "qwen3-0.6b"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.6)
    args = ap.parse_args()
    require_cuda()
    bandwidth = measure_hbm_bandwidth()
    llm = LLM(args.config, load_format="dummy", max_model_len=2064)
    prompts, _ = workload(args.num_seqs, 100, 1024, llm.config.hf_config["vocab_size"])
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1000)
    for p in prompts:
        llm.add_request(p, params)
    while any(s.num_uncomputed_tokens > 1 for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    for _ in range(3):  # warm-up decode steps
        llm.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    step_ms = 1e3 * (time.perf_counter() - t) / args.steps

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        llm.step()
    profiler.disable()

    seqs = llm.scheduler.running
    batch = len(seqs)
    graphs = llm.runner.graphs
    bucket = next(b for b in graphs.buckets if b >= batch)
    replay_ms = cuda_ms(graphs.graphs[bucket].replay)
    logits = graphs.logits[bucket][:batch]
    sample_params = [s.params for s in seqs]
    sample_ms = cuda_ms(lambda: sample(logits, sample_params, [None] * batch, llm.runner.default_generator))

    weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    layers, _, kv_heads, head_dim = llm.runner.kv_shape
    kv_bytes = sum(len(s) for s in seqs) * 2 * layers * kv_heads * head_dim * llm.runner.kv_cache.data.element_size()
    floor_ms = 1e3 * (weights + kv_bytes) / bandwidth
    results = {"batch": batch, "mean_context": sum(len(s) for s in seqs) / batch, "step_ms": step_ms,
               "graph_replay_ms": replay_ms, "sampler_ms": sample_ms, "host_ms": step_ms - replay_ms - sample_ms,
               "hbm_floor_ms": floor_ms}
    log(f"batch {batch}, mean context {results['mean_context']:.0f}: step {step_ms:.2f} ms = graph replay "
        f"{replay_ms:.2f} ms (HBM floor {floor_ms:.2f} ms, {floor_ms / replay_ms:.0%}) + sampler {sample_ms:.2f} ms "
        f"+ host {results['host_ms']:.2f} ms")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    log(text.getvalue())
    save_results("profile_step", results)


if __name__ == "__main__":
    main()
