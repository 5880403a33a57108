"""Where the throughput workload's time goes, step by step: GPU busy against wall time, and what the host
waits on, over windows of the run (early: large batches; late: the tail of long outputs).

Runs bench/throughput.py's workload through the engine loop (the steps `LLM.generate` takes), and profiles a few windows of
steps with torch.profiler: the union of the device's kernel and copy intervals over the window's wall
time says how much of the run the GPU is idle; the host ops table says where the host waited (event or
stream synchronisation, blocking copies). The whole run's steps are also timed on the host, grouped by
batch size, against each bucket's graph replay alone.

    PYTHONPATH=. python3 bench/profile_run.py [--async-scheduling] [--windows 50 400 800] [--window-steps 20]
        [--workload serving]   (bench/serving.py's: 1,000 prompts x 256 in / 128 out, greedy; its waves admit 32
                                prompts a step beside the running ones: `--windows 1 --window-steps 8` profiles them)
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from common import HERE, log, require_cuda, save_results
from throughput import workload
from nanovllm.engine.step_plan import STEP_KINDS
from nanovllm.serving_bench import make_workload
from nanovllm import LLM, SamplingParams


def busy_ms(prof) -> float:
    """Union of the device's activity intervals in a profile, in ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def graph_kernels(graph: torch.cuda.CUDAGraph) -> dict:
    """Kernels of one replay: how many, their summed time, and the span from the first start to the last
    end (span - sum = gaps between kernels inside the graph)."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not events:
        return {}
    per_name = defaultdict(float)
    for e in events:
        per_name[e.name] += (e.time_range.end - e.time_range.start) / 1e3
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:6]
    return {"kernels": len(events), "kernel_ms": sum(per_name.values()), "span_ms": span, "top": top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "qwen3-0.6b"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--windows", type=int, nargs="+", default=[50, 400, 800], help="step numbers where a window starts")
    ap.add_argument("--window-steps", type=int, default=20)
    ap.add_argument("--workload", choices=["throughput", "serving"], default="throughput")
    args = ap.parse_args()
    require_cuda()
    llm = LLM(args.config, load_format="dummy", max_model_len=2064, async_scheduling=args.async_scheduling)
    vocab = llm.config.hf_config["vocab_size"]
    warm, _ = workload(64, 100, 1024, vocab, seed=1)
    llm.generate(warm, SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True), use_tqdm=False)
    if args.workload == "serving":
        prompts, out_lens = make_workload(1000, 256, 128, vocab)
        temperature = 0.0
    else:
        prompts, out_lens = workload(args.num_seqs, 100, 1024, vocab)
        temperature = 0.6
    for p, n in zip(prompts, out_lens):
        llm.add_request(p, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n))
    windows, by_batch = [], defaultdict(list)
    step, t_run = 0, time.perf_counter()
    while llm.has_unfinished_requests():
        batch = len(llm.scheduler.running)
        if step in args.windows:
            torch.cuda.synchronize()
            t0, kinds = time.perf_counter(), tuple(llm.runner.planner.steps)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.window_steps):
                    llm._step(final_only=True)  # as LLM.generate steps
                torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - t0)
            busy = busy_ms(prof)
            kinds = {k: b - a for k, a, b in zip(STEP_KINDS, kinds, llm.runner.planner.steps) if b > a}
            windows.append({"start_step": step, "batch": batch, "wall_ms_per_step": wall / args.window_steps,
                            "gpu_busy_ms_per_step": busy / args.window_steps, "gpu_busy_fraction": busy / wall,
                            "step_kinds": kinds})
            log(f"steps {step}-{step + args.window_steps} (batch {batch}, {kinds}): {wall / args.window_steps:.2f} "
                f"ms/step wall, GPU busy {busy / args.window_steps:.2f} ms/step ({busy / wall:.0%})")
            log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
            log(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))
            step += args.window_steps
            continue
        t0 = time.perf_counter()
        llm._step(final_only=True)
        by_batch[batch].append(time.perf_counter() - t0)
        step += 1
    torch.cuda.synchronize()
    run_s = time.perf_counter() - t_run
    graphs = llm.runner.graphs
    rows = []
    for lo, hi in [(193, 256), (129, 192), (65, 128), (17, 64), (1, 16)]:
        times = [t for b, ts in by_batch.items() if lo <= b <= hi for t in ts]
        if times:
            rows.append({"batch": f"{lo}-{hi}", "steps": len(times), "host_ms_per_step": 1e3 * sum(times) / len(times)})
    replay = {}
    for bs in (256, 128, 64, 16):
        if graphs and bs in graphs.graphs:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graphs.graphs[bs].replay()
            end.record()
            end.synchronize()
            replay[bs] = start.elapsed_time(end) / 10
    kernels = graph_kernels(graphs.graphs[16]) if graphs and 16 in graphs.graphs else None
    if kernels:
        log(f"one bs-16 replay (short contexts): {kernels['kernels']} kernels, {kernels['kernel_ms']:.2f} ms of kernel "
            f"time in {kernels['span_ms']:.2f} ms from first start to last end; longest: "
            + ", ".join(f"{name[:40]} {ms:.3f} ms" for name, ms in kernels["top"]))
    log(f"whole run {run_s:.2f} s, {step} steps; step time on the host by batch: "
        + ", ".join(f"{r['batch']}: {r['host_ms_per_step']:.2f} ms x {r['steps']}" for r in rows)
        + "; graph replay alone: " + ", ".join(f"bs {b}: {ms:.2f} ms" for b, ms in replay.items()))
    save_results("profile_run", {"workload": args.workload, "async_scheduling": args.async_scheduling, "run_s": run_s,
                                 "steps": step, "windows": windows, "step_ms_by_batch": rows, "graph_replay_ms": replay,
                                 "bs16_graph_kernels": kernels})


if __name__ == "__main__":
    main()
