"""Where a decode step's time goes: torch.profiler over eager decode steps, kernels grouped by kind,
and the CUDA-graph step time beside the HBM floor of the same step, with the kernels its graphs replay and
the graph steps' timeline (GPU busy, launch latency, gaps between kernels, host time after the last kernel).

    PYTHONPATH=. python3 bench/profile_decode.py [--config bench/configs/llama-3.1-8b] [--batch 1] [--context 1024]
        [--sparse-policy quest --quest-token-budget 2048] [--gemv-rows 0] [--dependent-launch]

With a sparse policy (sparse from the first token on) the host-side operators are listed too: where the
CPU time of an eager step goes.
"""
from __future__ import annotations

import argparse
import gc
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from common import (HERE, add_dependent_launch_arg, kind_of, log, measure_hbm_bandwidth, require_cuda, save_results,
                    set_layer_ops)
from timeline import timeline_of
from nanovllm import LLM, SamplingParams

# Our Triton kernels by name (_decode_kernel, _merge_splits_kernel, _store_kv_kernel, _rms_norm_kernel, ...), cuBLAS's
# split-K reductions with their GEMMs.
KINDS = [("attention", ("paged", "attention", "merge", "decode_kernel", "prefill_kernel")),
         ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90", "matmul", "splitk")),
         ("kv store", ("index_copy", "indexcopy", "store_kv")),
         ("norm/rope/elementwise", ("norm", "rope", "silu", "elementwise", "reduce", "cat", "mean", "pow"))]


def step_time_ms(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return 1e3 * sum(o.metrics.time_per_output_token for o in outs) / len(outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "llama-3.1-8b"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sparse-policy", default="full")
    ap.add_argument("--quest-token-budget", type=int, default=2048)
    ap.add_argument("--gemv-rows", type=int,
                    help="narrow projections of steps of at most this many rows through the Triton GEMV "
                         "(TritonLayerOps.gemv_rows, default 1; 0: cuBLAS)")
    add_dependent_launch_arg(ap)
    args = ap.parse_args()
    sparse = {} if args.sparse_policy == "full" else dict(
        sparse_policy=args.sparse_policy, sparse_min_context=0, quest_token_budget=args.quest_token_budget)
    require_cuda()
    bandwidth = measure_hbm_bandwidth()
    prompts = [[(7 * i + j) % 1000 for j in range(args.context)] for i in range(args.batch)]
    results = {}
    for eager in (False, True):
        llm = LLM(args.config, load_format="dummy", max_model_len=args.context + 64, max_num_seqs=args.batch,
                  enforce_eager=eager, gpu_memory_utilization=0.9 if sparse else 0.5, **sparse)
        set_layer_ops(llm, args.gemv_rows, args.dependent_launch)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        results["eager_ms" if eager else "graph_ms"] = step_time_ms(llm, prompts, args.steps)
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if sparse or not eager else [])
        with profile(activities=activities) as prof:
            step_time_ms(llm, prompts, args.steps)
        if not eager:  # the kernels replayed inside the graphs
            graph_table = prof.key_averages().table(sort_by="device_time_total", row_limit=15)
            graph_timeline = timeline_of(prof)
        weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
        del llm
        gc.collect()  # the engine's reference cycles hold its memory until collected
        torch.cuda.empty_cache()
    by_kind: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.self_device_time_total > 0:  # kernels; a CPU operator's device time is its kernels'
            by_kind[kind_of(evt.key, KINDS)] += evt.self_device_time_total / 1e3
    gpu_ms = sum(by_kind.values())
    results["floor_ms_weights"] = 1e3 * weights / bandwidth
    results["gpu_busy_ms_per_step"] = gpu_ms / args.steps
    results["kernel_ms_per_step"] = {k: v / args.steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    log(f"step: CUDA graph {results['graph_ms']:.2f} ms, eager {results['eager_ms']:.2f} ms, "
        f"GPU busy {results['gpu_busy_ms_per_step']:.2f} ms, weight floor {results['floor_ms_weights']:.2f} ms")
    for kind, ms in results["kernel_ms_per_step"].items():
        log(f"  {kind:24s} {ms:6.2f} ms/step")
    log(prof.key_averages().table(sort_by="device_time_total", row_limit=12))
    log("kernels of the CUDA-graph steps:\n" + graph_table)
    log(graph_timeline)
    if sparse:
        log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    save_results("profile_decode", results)


if __name__ == "__main__":
    main()
