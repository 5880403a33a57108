"""Where a long prefill's GPU time goes, ours beside HF transformers' forward on the same shape: torch.profiler
over one prefill of `--context` tokens each (ours in its default chunks), kernels grouped by kind, each
kind's time as a share of the run and as a ratio to HF's. Random weights (the shape is what matters).

    PYTHONPATH=. python3 bench/profile_prefill.py [--config bench/configs/llama-3.1-8b] [--context 32768]
"""
from __future__ import annotations

import argparse
import gc
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from common import HERE, hf_model, kind_of, log, require_cuda, save_results, timed
from nanovllm import LLM, SamplingParams

KINDS = [
    ("attention", ("attention", "attn", "_prefill_kernel", "flash", "cudnn", "fmha", "sdpa", "softmax")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "matmul", "cublas")),
    ("kv store", ("index_copy", "indexcopy", "store_kv", "scatter")),
    ("norm/rope/activation", ("rms", "norm", "rope", "rotary", "silu", "mul", "add", "pow", "mean", "rsqrt")),
    ("copies/casts", ("copy", "cat", "convert", "to_copy", "fill")),
]


def kernel_ms_by_kind(prof) -> dict[str, float]:
    by_kind: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.self_device_time_total > 0:  # kernels; a CPU operator's device time is its kernels'
            by_kind[kind_of(evt.key, KINDS)] += evt.self_device_time_total / 1e3
    return dict(by_kind)


def profiled(fn) -> tuple[float, dict[str, float], str]:
    """(wall ms, kernel ms by kind, top kernels table) of one call of fn after a warm-up call."""
    fn()
    _, seconds = timed(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return 1e3 * seconds, kernel_ms_by_kind(prof), prof.key_averages().table(sort_by="device_time_total", row_limit=12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "llama-3.1-8b"))
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args()
    require_cuda()
    prompt = torch.randint(0, 32000, (args.context,)).tolist()
    # no prefix caching: the profiled call would otherwise find the warm-up call's blocks and skip the prefill
    llm = LLM(args.config, load_format="dummy", max_model_len=args.context + 16, max_num_seqs=1,
              gpu_memory_utilization=0.5, enable_prefix_caching=False)
    ours = profiled(lambda: llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False))
    del llm
    gc.collect()  # the engine's reference cycles hold its memory until collected
    torch.cuda.empty_cache()
    model = hf_model(args.config)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        theirs = profiled(lambda: model(ids, logits_to_keep=1))
    results = {"context": args.context}
    for name, (wall, kinds, table) in (("nanovllm", ours), ("hf", theirs)):
        results[name] = dict(wall_ms=wall, kernel_ms=kinds, gpu_busy_ms=sum(kinds.values()))
        log(f"{name}: {wall:.1f} ms wall, GPU busy {sum(kinds.values()):.1f} ms, "
            f"{args.context / wall * 1e3:,.0f} tok/s\n{table}")
    log(f"{'kind':24s} {'nanovllm ms':>12s} {'HF ms':>10s} {'ratio':>7s}")
    for kind in sorted(set(ours[1]) | set(theirs[1]), key=lambda k: -ours[1].get(k, 0.0)):
        a, b = ours[1].get(kind, 0.0), theirs[1].get(kind, 0.0)
        log(f"{kind:24s} {a:12.1f} {b:10.1f} {a / b if b else float('inf'):7.2f}")
    log(f"wall: nanovllm {ours[0]:.1f} ms, HF {theirs[0]:.1f} ms -> {theirs[0] / ours[0]:.2f}x HF's speed")
    save_results("profile_prefill", results)


if __name__ == "__main__":
    main()
