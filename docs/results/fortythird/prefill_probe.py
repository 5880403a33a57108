"""Time prefill_variants.py's kernel variants on one XAttention layer of bench/sparse.py's shaped 128K inputs
(Llama-3.1-8B shape, bf16; the estimate and selection made once by the engine's selector, then the block-sparse
kernel over the per-KV-head tables it passes), each variant's output against the base's.

    cd bench && PYTHONPATH=..:. python3 ../docs/results/fortythird/prefill_probe.py [--context 131072]
        [--variants base:4:3 exp16:4:3 pipe:8:3:128:128 ...]
        (name:warps:stages[:block_m:block_n], default tiles 128 x 64, descriptors)
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import prefill_variants  # noqa: E402
from common import cuda_ms, log  # noqa: E402
from nanovllm.kernels import triton_paged_attention as ops  # noqa: E402


def recorded_call(context: int, threshold: float) -> tuple[tuple, dict]:
    """The arguments of the block-sparse kernel's call in one XAttention layer (as tune_prefill's sweep builds it)."""
    from sparse import BLOCK, DIM, KV_HEADS, shaped_inputs
    from nanovllm.engine.kv_cache import PagedKVCache
    from nanovllm.layers.attention import get_attention_backend
    from nanovllm.layers.kv_access import DeviceKV
    from nanovllm.layers.xattention import XAttentionSelector

    q, k, v = shaped_inputs(context, seed=context)
    blocks = -(-context // BLOCK)
    cache = PagedKVCache(1, blocks, BLOCK, KV_HEADS, DIM, torch.bfloat16, torch.device("cuda"))
    backend = get_attention_backend("triton")
    table = torch.randperm(blocks).tolist()
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)]
    meta = backend.build_metadata([context], [context], [table], slots, BLOCK, torch.device("cuda"))
    selector = XAttentionSelector(cache, None, threshold, 16, 128, min_context=0)
    calls = []
    original = ops.paged_prefill_attention

    def record(*args, **kwargs):
        calls.append((args, dict(kwargs)))
        return original(*args, **kwargs)

    ops.paged_prefill_attention = record
    try:
        DeviceKV(cache, backend, meta, selector).attend(0, q, k, v, DIM**-0.5)
    finally:
        ops.paged_prefill_attention = original
    torch.cuda.synchronize()
    (args, kwargs), = calls
    kwargs.pop("out", None)
    log(f"recorded: tables {tuple(args[5].shape)}, schedule {tuple(kwargs['schedule'].shape)}, "
        f"config {kwargs['config']}")
    return args, kwargs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--variants", nargs="+", default=["base:4:3", "exp16:4:3", "noexp:4:3", "base:8:3", "pipe:8:3",
                                                       "pipe:8:2", "pipe_exp16:8:3", "exp16:8:3"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    call, kwargs = recorded_call(args.context, args.threshold)
    base_cfg = kwargs.pop("config")
    outputs: dict[str, torch.Tensor] = {}
    first_ms = None
    for spec in [*args.variants, args.variants[0]]:  # the first once more at the end: drift within the call
        name, warps, stages, *tiles = spec.split(":")
        block_m, block_n = map(int, tiles) if tiles else (base_cfg.block_m, base_cfg.block_n)
        module = prefill_variants.load(name)
        cfg = module.PrefillConfig(block_m, block_n, int(warps), int(stages), tma=base_cfg.tma,
                                   pack_heads=base_cfg.pack_heads)
        kw = {k: v for k, v in kwargs.items() if k != "schedule" or block_m == base_cfg.block_m}  # else rebuilt
        fn = lambda: module.paged_prefill_attention(*call, config=cfg, **kw)  # noqa: E731
        try:
            out = fn()[0].float()
        except Exception as exc:  # noqa: BLE001 - out of registers / shared memory for this variant
            log(f"{spec}: failed {type(exc).__name__}: {str(exc)[:200]}")
            continue
        want = outputs.setdefault("first", out)
        diff = (out - want).abs()
        ms = cuda_ms(fn, args.repeats)
        first_ms = first_ms or ms
        log(f"{spec}: {ms:.2f} ms, {first_ms / ms:.3f}x the first; max |diff| {diff.max().item():.4f}, "
            f"mean {diff.mean().item():.2e}")
    log("done")


if __name__ == "__main__":
    main()
