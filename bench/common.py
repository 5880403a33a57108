"""Shared helpers for the benchmarks: ceilings measured in the same process, and printing."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


def log(msg: str) -> None:
    print(msg, flush=True)


def measure_hbm_bandwidth(gib: float = 2.0, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / seconds


def hf_model(config_dir: Path, dtype=torch.bfloat16):
    """HF transformers model of the config's shape with random weights, built directly on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def kind_of(name: str, kinds: list[tuple[str, tuple[str, ...]]]) -> str:
    """The first kind of (kind, substrings) whose substring a kernel's name contains; "other" if none."""
    low = name.lower()
    for kind, keys in kinds:
        if any(k in low for k in keys):
            return kind
    return "other"


def cuda_ms(fn, repeats: int = 20) -> float:
    """Mean GPU time of fn() in ms over repeats calls, after one untimed call (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def graph_ms(fn, repeats: int = 20) -> float:
    """Mean GPU time of fn() in ms, repeats calls captured in one CUDA graph and replayed: kernels shorter than
    their host launch (Triton's launcher costs tens of us) are timed as they run inside the engine's decode
    graphs, where cuda_ms would time the launches."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * repeats)


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - t


def add_dependent_launch_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dependent-launch", action=argparse.BooleanOptionalAction,
                    help="the GEMV, norm, SiLU, RoPE, decode attention and merge kernels launched dependently, or not "
                         "(TritonLayerOps.dependent_launch and the Triton backend's; default: the engine's)")


def set_layer_ops(llm, gemv_rows: int | None, dependent_launch: bool | None = None) -> None:
    """A bench's --gemv-rows (the rows up to which the engine's projections run through the Triton GEMV) and
    --dependent-launch / --no-dependent-launch (TritonLayerOps.dependent_launch and the attention backend's; None:
    the engine's default for either), the decode graphs recaptured and the start-up's eager steps run again when
    either changes. Before the first request."""
    ops = llm.runner.layer_ops
    wanted = {"gemv_rows": gemv_rows, "dependent_launch": dependent_launch}
    changed = {k: v for k, v in wanted.items() if v is not None and getattr(ops, k, None) != v}
    if not changed:
        return
    if sum(llm.stats().steps):
        raise SystemExit("set_layer_ops runs before the engine's first request (its warm-up writes the first blocks)")
    if ops.name != "triton":
        raise SystemExit(f"--gemv-rows / --dependent-launch need the Triton layer ops, the engine runs {ops.name!r}")
    for name, value in changed.items():
        setattr(ops, name, value)
    if "dependent_launch" in changed:  # the decode attention and merge kernels too
        llm.runner.backend.dependent_launch = changed["dependent_launch"]
    llm.runner.recapture_decode_graphs()
    worker = llm.runner.worker
    if worker.device.type == "cuda":  # the eager steps' variants too: none compiled on the request path
        from nanovllm.engine.warm_up import compile_step_variants

        compile_step_variants(worker)


def save_results(name: str, results: dict) -> None:
    out = os.environ.get("OUT") or str(HERE / "results")
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    log(f"results written to {path}")


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")


def sdpa_causal_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   repeats: int = 3) -> tuple[float, str]:
    """The faster of torch SDPA's cuDNN and flash backends on causal attention of q/k/v [1, H, L, D]."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = (float("inf"), "none")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                ms = cuda_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), repeats)
            best = min(best, (ms, backend.name))
        except RuntimeError as e:
            log(f"  SDPA {backend.name}: not available ({str(e).splitlines()[0][:80]})")
    return best
