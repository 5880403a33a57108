"""Few-row linear layers (decode at batch 1-4): cuBLAS against the Triton GEMV (kernels/triton_gemv.py).

For each projection of a model config (q/k/v, o, gate/up, down) and each row count, the time of one call inside a
CUDA graph (as in the engine's decode graphs; split-K reductions included) for F.linear through cuBLAS, F.linear
with cuBLASLt preferred, the Triton kernel at the tiles the engine picks (`gemv_tiles`) and over a sweep of tiles,
warps and stages (each checked against F.linear in float32). Prints microseconds and the weights' bytes over that
time as a fraction of the measured HBM copy bandwidth, per shape and summed over a layer: cuBLAS everywhere
against what `TritonLayerOps.linear` runs (the GEMV for the narrow projections, cuBLAS for the others; gate/up goes
through `gemv_silu` with SiLU * up in its epilogue, timed by docs/results/fortysecond/mlp_chain.py).

    PYTHONPATH=. python3 bench/tune_gemv.py [--model bench/configs/llama-3.1-8b] [--rows 1 4] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from common import graph_ms, log, measure_hbm_bandwidth, require_cuda, save_results
from nanovllm.kernels.triton_gemv import gemv, gemv_tiles
from nanovllm.layers.fused_ops import TritonLayerOps


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each of a decoder layer's four GEMMs."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def cublas_ms(x: torch.Tensor, w: torch.Tensor, library: str) -> float:
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return graph_ms(lambda: F.linear(x, w))
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def sweep(x: torch.Tensor, w: torch.Tensor, grid: dict) -> list[dict]:
    want = F.linear(x.float(), w.float())
    rows = []
    for block_n, block_k, warps, stages in itertools.product(*grid.values()):
        launch = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
        fn = lambda: gemv(x, w, **launch)  # noqa: E731
        try:
            got = fn()
        except Exception as exc:  # out of registers for this combination
            log(f"   {launch} failed: {type(exc).__name__}")
            continue
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)
        rows.append({**launch, "ms": graph_ms(fn)})
    return sorted(rows, key=lambda r: r["ms"])


def describe(launch: dict) -> str:
    return (f"block_n {launch['block_n']} block_k {launch['block_k']} warps {launch['num_warps']} "
            f"stages {launch['num_stages']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).parent / "configs" / "llama-3.1-8b"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--quick", action="store_true", help="fewer launch configurations")
    args = ap.parse_args()
    require_cuda()
    config = json.loads((Path(args.model) / "config.json").read_text())
    bandwidth = measure_hbm_bandwidth()
    log(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s; {Path(args.model).name}, bf16")
    grid = dict(block_n=(2, 4, 8, 16), block_k=(256, 512, 1024), num_warps=(2, 4, 8), num_stages=(1, 2, 3))
    if args.quick:
        grid = dict(block_n=(4, 8), block_k=(512, 1024), num_warps=(4,), num_stages=(1, 2))
    of_hbm = lambda nbytes, ms: nbytes / (ms / 1e3) / bandwidth  # noqa: E731
    results = {"bandwidth": bandwidth, "model": Path(args.model).name, "shapes": {}}
    for m in args.rows:
        layer = {"cublas": 0.0, "cublaslt": 0.0, "triton_best": 0.0, "engine": 0.0, "bytes": 0}
        ops = TritonLayerOps(gemv_rows=m)
        for name, (n, k) in projections(config).items():
            g = torch.Generator("cuda").manual_seed(0)
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            w = linear.weight.data
            w.copy_(torch.randn(n, k, generator=g, device="cuda") / k**0.5)
            nbytes = w.numel() * w.element_size()
            peers = {library: cublas_ms(x, w, library) for library in ("cublas", "cublaslt")}
            default_ms = graph_ms(lambda: gemv(x, w))
            engine_ms = graph_ms(lambda: ops.linear(x, linear))
            rows = sweep(x, w, grid)
            best = rows[0]["ms"]
            for key, ms in (*peers.items(), ("triton_best", best), ("engine", engine_ms)):
                layer[key] += ms
            layer["bytes"] += nbytes
            results["shapes"][f"{name} m={m}"] = {"n": n, "k": k, **{f"{p}_ms": ms for p, ms in peers.items()},
                                                  "gemv_tiles": gemv_tiles(n, k), "gemv_default_ms": default_ms,
                                                  "engine_ms": engine_ms, "triton_best": rows[:5]}
            log(f"{name:8s} m={m} [{n}x{k}] cuBLAS {peers['cublas'] * 1e3:6.1f} us "
                f"({of_hbm(nbytes, peers['cublas']):.0%} of HBM), cuBLASLt {peers['cublaslt'] * 1e3:6.1f} us, "
                f"GEMV at its tiles {gemv_tiles(n, k)} {default_ms * 1e3:6.1f} us "
                f"({peers['cublas'] / default_ms:.2f}x cuBLAS), best {best * 1e3:6.1f} us {describe(rows[0])}; "
                f"the engine's {'GEMV' if ops._through_gemv(x, linear) else 'cuBLAS'} {engine_ms * 1e3:6.1f} us")
        log(f"layer m={m}: cuBLAS {layer['cublas'] * 1e3:.1f} us "
            f"({of_hbm(layer['bytes'], layer['cublas']):.0%} of HBM), cuBLASLt {layer['cublaslt'] * 1e3:.1f} us, "
            f"the engine's choice {layer['engine'] * 1e3:.1f} us ({of_hbm(layer['bytes'], layer['engine']):.0%}): "
            f"{layer['cublas'] / layer['engine']:.2f}x cuBLAS (the GEMV's best tiles everywhere "
            f"{layer['triton_best'] * 1e3:.1f} us)")
        results[f"layer m={m}"] = layer
    save_results("tune_gemv", results)


if __name__ == "__main__":
    main()
