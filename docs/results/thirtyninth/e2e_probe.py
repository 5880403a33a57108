"""Where the end-to-end 128K XAttention prefill (issue #15: 1.92x dense, 2x wanted) leaves the GPU idle.

One engine each, dense and XAttention (bench/sparse.py's e2e setup: Llama-3.1-8B shape, random weights, threshold 0.2,
group cover, chunks of --chunk tokens), a warm run, then for each: (1) a run under torch.cuda.set_sync_debug_mode
("warn"), every synchronising call counted by the Python line that made it; (2) a profiled run: wall, GPU busy
(the union of kernel and copy intervals), the gaps between device activity longer than 20 us summed by the host op
that was running when the gap began, and the kernels by total time.

    cd bench && PYTHONPATH=$PYTHONPATH:$PWD python3 ../docs/results/thirtyninth/e2e_probe.py [--context 131071] \
        [--chunk 32768]
"""
from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from common import HERE, log
from sparse import random_prompts
from nanovllm import LLM, SamplingParams


def sync_sites(llm, prompt, params) -> collections.Counter:
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/nanovllm/" in f.filename]
        where = " < ".join(f"{f.filename.split('/nanovllm/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        sites[where] += 1

    old = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        llm.generate([prompt], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return sites


def gaps(prof, min_us: float = 20.0) -> tuple[float, float, collections.Counter, collections.Counter]:
    """Busy ms, idle ms in gaps > min_us, the gaps' ms by the host op running at their start, kernels' ms by name."""
    events = prof.events()
    device = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "aten::", "cu"))]
    kernels: collections.Counter = collections.Counter()
    busy, end, idle, by_op = 0.0, None, 0.0, collections.Counter()
    for s, e, name in device:
        kernels[name[:70]] += (e - s) / 1e3
        if end is not None and s - end > min_us:
            running = [h for h in host if h[0] <= end <= h[1]]
            # the innermost (shortest) host op running when the device went idle
            op = min(running, key=lambda h: h[1] - h[0])[2] if running else "(no host op)"
            by_op[op] += (s - end) / 1e3
            idle += (s - end) / 1e3
        if end is None or e > end:
            busy += (e - max(s, end)) / 1e3 if end is not None else (e - s) / 1e3
            end = e
    return busy, idle, by_op, kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(HERE / "configs" / "llama-3.1-8b"))
    ap.add_argument("--context", type=int, default=131071)
    ap.add_argument("--chunk", type=int, default=32768)
    ap.add_argument("--threshold", type=float, default=0.2)
    ap.add_argument("--policies", nargs="+", default=["xattention", "full"])
    args = ap.parse_args()
    block = 256
    max_model_len = args.context + 1
    common = dict(load_format="dummy", sparse_min_context=0, xattn_threshold=args.threshold, xattn_cover="group",
                  enable_prefix_caching=False, max_model_len=max_model_len, max_num_seqs=1,
                  num_gpu_blocks=-(-max_model_len // block) + 2, max_num_batched_tokens=args.chunk)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for name in args.policies:
        llm = LLM(args.config, sparse_policy=name, **common)
        prompt = random_prompts(llm.config.hf_config["vocab_size"], 1, args.context, args.context)[0]
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        log(f"== {name}: {time.perf_counter() - start:.3f} s (unprofiled)")
        sites = sync_sites(llm, prompt, params)
        log(f"synchronising calls: {sum(sites.values())}")
        for where, n in sites.most_common(12):
            log(f"  {n:5d}  {where}")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3
        busy, idle, by_op, kernels = gaps(prof)
        log(f"profiled: wall {wall:.0f} ms, GPU busy {busy:.0f} ms, idle in gaps > 20 us {idle:.0f} ms")
        for op, ms in by_op.most_common(10):
            log(f"  gap {ms:8.1f} ms after {op}")
        for k, ms in kernels.most_common(14):
            log(f"  kernel {ms:8.1f} ms  {k}")
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=40,
                                                                    max_name_column_width=40, max_shapes_column_width=90)
        log("\n".join("  shape " + line for line in table.splitlines()))
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
