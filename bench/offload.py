"""KV-cache CPU offload on a Llama-3.1-8B-shaped model (random bf16 weights), in one process:

- the offload engine gets the KV budget a 24 GB card would leave (24 GiB - weights - ACTIVATION_GIB
  for activations, CUDA context and the staging ring), the rest of the KV goes to pinned host memory;
- the same cases on a GPU-only engine with the whole card: prefill tokens/s ratio (target >= 90% at 32K);
- decode ms per step against the PCIe floor: host-resident KV bytes read per step over the measured
  pinned host-to-device bandwidth (target within 1.15x), and the PCIe GB/s achieved; decode steps
  whose host KV fits a ring slot replay CUDA graphs that copy it in (memcpy nodes re-addressed per
  step); the same steps eager are the peer;
- logprobs of every prompt position of a 32K x 4 batch, offload against GPU-only (max abs difference);
- HF transformers generate with its offloaded cache (cache_implementation="offloaded") at 32K.

    PYTHONPATH=. python3 bench/offload.py [--cases 1x32768 4x32768 ...] [--decode-steps 8] [--skip-hf] [--trace]
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch

from common import HERE, cuda_ms, hf_model, log, require_cuda, save_results, timed
from nanovllm import LLM, SamplingParams

CARD_GIB = 24
ACTIVATION_GIB = 2.5
DEFAULT_CASES = ["1x32768", "4x32768", "1x65536", "4x65536", "1x131072", "4x131072"]


def measure_h2d_bandwidth(gib: float = 2.0, repeats: int = 3) -> float:
    """Pinned host-to-device copy bandwidth in bytes/s: the best of one large copy and the same bytes as
    back-to-back 32 MiB copies (the size of the offload engine's per-layer copies)."""
    n = int(gib * 2**30)
    chunk = 32 * 2**20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")

    def whole() -> None:
        dst.copy_(src, non_blocking=True)

    def chunked() -> None:
        for start in range(0, n, chunk):
            dst[start : start + chunk].copy_(src[start : start + chunk], non_blocking=True)

    best = max(n / (cuda_ms(copy, repeats) / 1e3) for copy in (whole, chunked))
    src = dst = None  # noqa: F841 (freed before emptying the cache)
    torch.cuda.empty_cache()
    return best


def parse_cases(cases: list[str], max_len: int, decode_steps: int) -> list[tuple[int, int]]:
    out = []
    for case in cases:
        batch, context = (int(x) for x in case.split("x"))
        out.append((batch, min(context, max_len - 512)))  # 128K: leave room for the tokens generated meanwhile
    return out


def random_prompts(vocab: int, batch: int, context: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]


def run_case(llm: LLM, prompts: list[list[int]], decode_steps: int, trace: str | None = None) -> dict:
    """Prefill all prompts (until every request has its first token), then time decode_steps steps.
    trace: also profile one more decode step (CPU and CUDA) into this Chrome-trace file."""
    # Early requests must still be decoding when the last one gets its first token: a generous max_tokens,
    # and the requests are aborted after the measured steps.
    prefill_steps = -(-sum(map(len, prompts)) // llm.config.max_num_batched_tokens) + len(prompts)
    params = SamplingParams(temperature=0, max_tokens=decode_steps + prefill_steps + 4, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    started: set[str] = set()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while len(started) < len(ids):
        started.update(o.request_id for o in llm.step())
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    for _ in range(2):  # untimed: the first decode steps of a new shape compile kernel variants
        llm.step()
    host_blocks = llm.block_manager.num_used_host_blocks
    result = {"prefill_tok_s": sum(map(len, prompts)) / prefill_s, "prefill_s": prefill_s,
              "host_blocks": host_blocks, **time_decode(llm, decode_steps)}
    if llm.runner.host_pool and host_blocks:  # the peer: the same steps eager, split attention over ring pieces
        llm.runner.staged_decode = False
        llm.step()  # untimed, as above
        result["ring_decode"] = time_decode(llm, decode_steps)
        llm.runner.staged_decode = True
    if trace:
        profile_step(llm, trace)
    for request_id in ids:
        llm.abort_request(request_id)
    result["preemptions"] = llm.scheduler.num_preemptions
    return result


def time_decode(llm: LLM, steps: int) -> dict:
    """ms per decode step, and the host KV it copies to the device per step."""
    offloader = llm.runner.host_pool
    before = vars(offloader.stats).copy() if offloader else {}
    replays_before = llm.runner.graphs.num_replays if llm.runner.graphs else 0
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    delta = {k: (v - before[k]) / steps for k, v in vars(offloader.stats).items()} if offloader else {}
    replays = llm.runner.graphs.num_replays if llm.runner.graphs else 0
    return {"decode_ms": 1e3 * seconds, "host_bytes_per_step": delta.get("h2d_bytes", 0),
            "h2d_copies_per_step": delta.get("h2d_copies", 0), "graph_steps": replays - replays_before}


def profile_step(llm: LLM, path: str) -> None:
    """One engine step under torch.profiler: the Chrome trace shows whether the CPU (launching) or the
    GPU and copy engines set the pace; the table lists where device and host time went."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    log(prof.key_averages().table(sort_by="device_time_total", row_limit=8))
    log(f"trace written to {path}")


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    """Logprob of every prompt token. Enough new tokens that the first requests are still running when the
    last one prefills: all four stay resident, so with offload most of the batch's KV is on the host."""
    steps = -(-sum(map(len, prompts)) // llm.config.max_num_batched_tokens) + len(prompts)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[next(iter(d.values())) for d in o.prompt_logprobs[1:]] for o in outs]


def warm_up(llm: LLM, vocab: int) -> None:
    """Compile every kernel variant; with offload the prompts overflow the device pool, so its paths run too."""
    tokens = (llm.block_manager.num_blocks + 16) * llm.config.kvcache_block_size if llm.runner.host_pool else 8192
    llm.generate(random_prompts(vocab, 4, min(tokens // 4, 32768), 99), SamplingParams(max_tokens=3), use_tqdm=False)


def release_memory() -> None:
    """After the caller dropped its engine: collect it and return its memory to the driver."""
    gc.collect()
    torch.cuda.empty_cache()


def hf_offloaded(config_dir: str, context: int, decode_steps: int) -> dict:
    model = hf_model(config_dir)
    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    gen = dict(do_sample=False, cache_implementation="offloaded", pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :256], max_new_tokens=2, **gen)  # warm-up
        _, prefill_s = timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen))
        _, total_s = timed(lambda: model.generate(ids, max_new_tokens=decode_steps + 1,
                                                  min_new_tokens=decode_steps + 1, **gen))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"context": context, "prefill_tok_s": context / prefill_s,
            "decode_ms": 1e3 * (total_s - prefill_s) / decode_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "llama-3.1-8b"))
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="BATCHxCONTEXT")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-gpu-only", action="store_true")
    ap.add_argument("--trace", action="store_true", help="profile one decode step per offload case (Chrome trace)")
    args = ap.parse_args()
    require_cuda()
    h2d = measure_h2d_bandwidth()
    log(f"pinned host->device bandwidth: {h2d / 1e9:.1f} GB/s")
    common = dict(load_format="dummy")
    results: dict = {"h2d_bandwidth_gbs": h2d / 1e9, "cases": [], "card_gib": CARD_GIB}

    probe = LLM(args.config, num_gpu_blocks=1, load_format="dummy", enforce_eager=True)
    max_len = probe.config.max_model_len
    vocab = probe.config.hf_config["vocab_size"]
    weight_bytes = sum(p.numel() * p.element_size() for p in probe.runner.model.parameters())
    block_bytes = probe.runner.bytes_per_block
    probe = None
    release_memory()
    cases = parse_cases(args.cases, max_len, args.decode_steps)
    kv_bytes_needed = max(b * (c + args.decode_steps + 2) for b, c in cases) * block_bytes / 256
    device_gib = CARD_GIB - weight_bytes / 2**30 - ACTIVATION_GIB
    num_gpu_blocks = int(device_gib * 2**30 // block_bytes)
    host_gib = kv_bytes_needed / 2**30 - num_gpu_blocks * block_bytes / 2**30 + 1
    results.update(num_gpu_blocks=num_gpu_blocks, device_kv_gib=num_gpu_blocks * block_bytes / 2**30,
                   host_kv_gib=host_gib, weights_gib=weight_bytes / 2**30)
    log(f"24 GB card budget: {num_gpu_blocks} device blocks ({num_gpu_blocks * block_bytes / 2**30:.1f} GiB), "
        f"host pool {host_gib:.1f} GiB")

    logprob_case = [c for c in cases if c == (4, 32768)]
    reference_logprobs = None
    gpu_only: dict = {}
    if not args.skip_gpu_only:
        llm = LLM(args.config, max_model_len=max_len, **common)
        warm_up(llm, vocab)
        for batch, context in cases:
            prompts = random_prompts(vocab, batch, context, context + batch)
            # untimed, other prompts of the same shape (no prefix-cache hits): compiles this case's kernels
            run_case(llm, random_prompts(vocab, batch, context, context + batch + 1000), args.decode_steps)
            gpu_only[(batch, context)] = r = run_case(llm, prompts, args.decode_steps)
            log(f"GPU-only {batch}x{context}: prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_ms']:.1f} ms")
        if logprob_case:
            reference_logprobs = prompt_logprobs(llm, random_prompts(vocab, 4, 32768, 7))
        llm = None
        release_memory()

    llm = LLM(args.config, max_model_len=max_len, num_gpu_blocks=num_gpu_blocks, enable_cpu_offload=True,
              cpu_kv_cache_gb=host_gib, **common)
    warm_up(llm, vocab)
    for batch, context in cases:
        prompts = random_prompts(vocab, batch, context, context + batch)
        # untimed, other prompts of the same shape (no prefix-cache hits): compiles this case's kernels
        run_case(llm, random_prompts(vocab, batch, context, context + batch + 1000), args.decode_steps)
        trace = str(Path(os.environ.get("OUT") or HERE / "results") / f"offload_trace_{batch}x{context}.json")
        r = run_case(llm, prompts, args.decode_steps, trace if args.trace else None)
        for d in (r, r.get("ring_decode")):
            if d:
                floor_ms = 1e3 * d["host_bytes_per_step"] / h2d
                d.update(pcie_floor_ms=floor_ms, decode_vs_floor=d["decode_ms"] / floor_ms if floor_ms else None,
                         achieved_pcie_gbs=d["host_bytes_per_step"] / (d["decode_ms"] / 1e3) / 1e9)
        r.update(batch=batch, context=context)
        ring = r.get("ring_decode")
        peer = gpu_only.get((batch, context))
        if peer:
            r.update(gpu_only=peer, prefill_vs_gpu_only=r["prefill_tok_s"] / peer["prefill_tok_s"])
        results["cases"].append(r)
        log(f"offload {batch}x{context}: prefill {r['prefill_tok_s']:.0f} tok/s"
            + (f" = {r['prefill_vs_gpu_only']:.0%} of GPU-only" if peer else "")
            + f"; decode {r['decode_ms']:.1f} ms/step, {r['host_blocks']} host blocks, "
            f"floor {r['pcie_floor_ms']:.1f} ms" + (f" -> {r['decode_vs_floor']:.2f}x" if r['pcie_floor_ms'] else "")
            + f", {r['achieved_pcie_gbs']:.1f} GB/s, {r['graph_steps']}/{args.decode_steps} in graphs"
            + (f"; eager {ring['decode_ms']:.1f} ms/step ({ring['decode_vs_floor']:.2f}x, "
               f"{ring['achieved_pcie_gbs']:.1f} GB/s)" if ring else ""))
    if reference_logprobs is not None:
        offloaded_before = llm.runner.host_pool.stats.d2h_bytes
        got = prompt_logprobs(llm, random_prompts(vocab, 4, 32768, 7))
        diffs = torch.tensor([a - b for x, y in zip(got, reference_logprobs) for a, b in zip(x, y)]).abs()
        results["logprob_check_4x32768"] = {
            "max_abs_diff": diffs.max().item(), "mean_abs_diff": diffs.mean().item(), "positions": diffs.numel(),
            "offloaded_gib": (llm.runner.host_pool.stats.d2h_bytes - offloaded_before) / 2**30}
        log(f"prompt logprobs 4x32K offload vs GPU-only: max |diff| {diffs.max():.2e}, mean {diffs.mean():.2e}, "
            f"{results['logprob_check_4x32768']['offloaded_gib']:.1f} GiB offloaded meanwhile")
    llm = None
    release_memory()

    if not args.skip_hf:
        try:
            hf = hf_offloaded(args.config, 32768, min(args.decode_steps, 4))
            results["hf_offloaded_32k"] = hf
            ours = next((c for c in results["cases"] if c["batch"] == 1 and c["context"] == 32768), None)
            log(f"HF offloaded cache 32K: prefill {hf['prefill_tok_s']:.0f} tok/s, decode {hf['decode_ms']:.1f} ms"
                + (f"; ours {ours['prefill_tok_s'] / hf['prefill_tok_s']:.1f}x prefill, "
                   f"{hf['decode_ms'] / ours['decode_ms']:.1f}x decode" if ours else ""))
        except Exception as e:  # report, keep the other results
            results["hf_offloaded_32k"] = {"error": repr(e)}
            log(f"HF offloaded cache failed: {e!r}")
    save_results("offload", results)


if __name__ == "__main__":
    main()
