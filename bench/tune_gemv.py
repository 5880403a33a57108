"""Few-row linear layers (decode at batch 1-16): cuBLAS against the Triton GEMV (kernels/triton_gemv.py).

For each projection of a model config (q/k/v, o, gate/up, down) and each row count, the time of one call inside a
CUDA graph (as in the engine's decode graphs; split-K reductions included) for F.linear through cuBLAS, F.linear
with cuBLASLt preferred, and the Triton kernel over a sweep of tiles, warps and stages (each checked against
F.linear in float32): tl.dot over rows padded to 16, and (up to 4 rows) products summed in registers. Prints
microseconds and the weights' bytes over that time as a fraction of the measured HBM copy bandwidth, per shape
and summed over a layer. Then the layer as the model runs it, with the op before each
projection (residual add + RMSNorm before q/k/v and gate/up, SiLU * up before down): the Triton op and cuBLAS
against the GEMV with that op fused in (the sweep's five best tiles for the shape).

    PYTHONPATH=. python3 bench/tune_gemv.py [--model bench/configs/llama-3.1-8b] [--rows 1 4 16] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from common import graph_ms, log, measure_hbm_bandwidth, require_cuda, save_results
from nanovllm.kernels.triton_gemv import MAX_REGISTER_ROWS, gemv
from nanovllm.layers.fused_ops import get_layer_ops


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


def sweep(x: torch.Tensor, w: torch.Tensor, grids: dict[bool, dict]) -> list[dict]:
    """grids: per use_dot (tl.dot, or products summed in registers) the launch values to try."""
    want = F.linear(x.float(), w.float())
    rows = []
    for use_dot, grid in grids.items():
        if not use_dot and x.shape[0] > MAX_REGISTER_ROWS:
            continue
        for block_n, block_k, warps, stages in itertools.product(*grid.values()):
            launch = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, use_dot=use_dot)
            fn = lambda: gemv(x, w, **launch)  # noqa: E731
            try:
                got = fn()
            except Exception as exc:  # out of shared memory or registers for this combination
                log(f"   {launch} failed: {type(exc).__name__}")
                continue
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)
            rows.append({**launch, "ms": graph_ms(fn)})
    return sorted(rows, key=lambda r: r["ms"])


def describe(launch: dict) -> str:
    return (f"{'dot' if launch['use_dot'] else 'registers'} block_n {launch['block_n']} block_k {launch['block_k']} "
            f"warps {launch['num_warps']} stages {launch['num_stages']}")


def fused_layer(config: dict, m: int, tops: dict[str, list[dict]], of_hbm) -> dict:
    """The layer's four projections each after its op: Triton op + cuBLAS against the GEMV with the op fused in."""
    ops = get_layer_ops("triton")
    g = torch.Generator("cuda").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    total = {"separate": 0.0, "fused": 0.0, "bytes": 0}
    for name, (n, k) in projections(config).items():
        w = rand(n, k) / k**0.5
        if name == "down":
            x = rand(m, 2 * k)
            separate = lambda: F.linear(ops.silu_and_mul(x), w)  # noqa: E731
            prologue = dict(silu_mul=True)
        elif name == "o":
            x = rand(m, k)
            separate = lambda: F.linear(x, w)  # noqa: E731
            prologue = {}
        else:
            x, residual, norm_weight = rand(m, k), rand(m, k), rand(k)
            separate = lambda: F.linear(ops.add_rms_norm(x, residual, norm_weight, 1e-5)[0], w)  # noqa: E731
            prologue = dict(norm=(norm_weight, 1e-5), residual=residual)
        want = separate()
        times = []
        for cfg in tops[name]:
            launch = {key: cfg[key] for key in ("block_n", "block_k", "num_warps", "num_stages", "use_dot")}
            fn = lambda: gemv(x, w, **launch, **prologue)  # noqa: E731
            got = fn()
            got = got[0] if isinstance(got, tuple) else got
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)
            times.append(graph_ms(fn))
        separate_ms, fused_ms = graph_ms(separate), min(times)
        total["separate"] += separate_ms
        total["fused"] += fused_ms
        total["bytes"] += w.numel() * w.element_size()
        log(f"  {name:8s} m={m:2d} op + cuBLAS {separate_ms * 1e3:6.1f} us, fused GEMV {fused_ms * 1e3:6.1f} us "
            f"({separate_ms / fused_ms:.2f}x)")
    log(f"layer m={m} with its ops: Triton ops + cuBLAS {total['separate'] * 1e3:.1f} us "
        f"({of_hbm(total['bytes'], total['separate']):.0%} of HBM), fused GEMVs {total['fused'] * 1e3:.1f} us "
        f"({of_hbm(total['bytes'], total['fused']):.0%}): {total['separate'] / total['fused']:.2f}x")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).parent / "configs" / "llama-3.1-8b"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--quick", action="store_true", help="fewer launch configurations")
    args = ap.parse_args()
    require_cuda()
    config = json.loads((Path(args.model) / "config.json").read_text())
    bandwidth = measure_hbm_bandwidth()
    log(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s; {Path(args.model).name}, bf16")
    grids = {True: dict(block_n=(16, 32, 64), block_k=(128, 256, 512), num_warps=(4, 8), num_stages=(2, 3, 4, 5)),
             False: dict(block_n=(2, 4, 8, 16), block_k=(256, 512, 1024), num_warps=(4, 8), num_stages=(1, 2, 3))}
    if args.quick:
        grids = {True: dict(block_n=(16, 32), block_k=(256, 512), num_warps=(4,), num_stages=(3, 4)),
                 False: dict(block_n=(4, 8), block_k=(512, 1024), num_warps=(4,), num_stages=(1, 2))}
    of_hbm = lambda nbytes, ms: nbytes / (ms / 1e3) / bandwidth  # noqa: E731
    results = {"bandwidth": bandwidth, "model": Path(args.model).name, "shapes": {}}
    for m in args.rows:
        layer = {"cublas": 0.0, "cublaslt": 0.0, "triton": 0.0, "bytes": 0}
        tops: dict[str, list[dict]] = {}
        for name, (n, k) in projections(config).items():
            g = torch.Generator("cuda").manual_seed(0)
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
            nbytes = w.numel() * w.element_size()
            peers = {library: cublas_ms(x, w, library) for library in ("cublas", "cublaslt")}
            rows = sweep(x, w, grids)
            tops[name] = rows[:5]
            best = rows[0]["ms"]
            for key, ms in (*peers.items(), ("triton", best)):
                layer[key] += ms
            layer["bytes"] += nbytes
            results["shapes"][f"{name} m={m}"] = {"n": n, "k": k, **{f"{p}_ms": ms for p, ms in peers.items()},
                                                  "triton_best": rows[:5]}
            log(f"{name:8s} m={m:2d} [{n}x{k}] cuBLAS {peers['cublas'] * 1e3:6.1f} us "
                f"({of_hbm(nbytes, peers['cublas']):.0%} of HBM), cuBLASLt {peers['cublaslt'] * 1e3:6.1f} us "
                f"({of_hbm(nbytes, peers['cublaslt']):.0%}), Triton {best * 1e3:6.1f} us ({of_hbm(nbytes, best):.0%}; "
                f"{peers['cublas'] / best:.2f}x cuBLAS) {describe(rows[0])}")
        fused = fused_layer(config, m, tops, of_hbm)
        results[f"fused layer m={m}"] = fused
        log(f"layer m={m}: cuBLAS {layer['cublas'] * 1e3:.1f} us "
            f"({of_hbm(layer['bytes'], layer['cublas']):.0%} of HBM), cuBLASLt {layer['cublaslt'] * 1e3:.1f} us "
            f"({of_hbm(layer['bytes'], layer['cublaslt']):.0%}), Triton (best per shape) "
            f"{layer['triton'] * 1e3:.1f} us "
            f"({of_hbm(layer['bytes'], layer['triton']):.0%}): "
            f"{layer['cublas'] / layer['triton']:.2f}x cuBLAS")
        results[f"layer m={m}"] = layer
    save_results("tune_gemv", results)


if __name__ == "__main__":
    main()
