"""The softmax-granule-sums kernel (XAttention's estimate) over its column block and warps, on the scores of one
8,192-query estimate chunk at 32K / 128K keys (Llama-3.1-8B: 32 query heads, stride 16, 256-token granules):
ms per call and the bytes of its two reads per second, each variant checked against the default.

    python3 docs/results/fortieth/sums_tune.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from common import cuda_ms as ms  # noqa: E402
from nanovllm.kernels.triton_xattention import softmax_granule_sums  # noqa: E402


for keys in (32768, 131072):
    tiles, columns, granule_tiles = 8192 // 16, keys // 16, 16
    scores = torch.randn(32, tiles, columns, dtype=torch.bfloat16, device="cuda")
    scores[:, :, columns - tiles:].masked_fill_(torch.ones(tiles, tiles, dtype=torch.bool, device="cuda").triu_(1),
                                                float("-inf"))
    rows, granules = tiles // granule_tiles, columns // granule_tiles
    want = softmax_granule_sums(scores, 0, rows, granules, granule_tiles)
    base = ms(lambda: softmax_granule_sums(scores, 0, rows, granules, granule_tiles))
    print(f"{keys} keys: default {base:.3f} ms ({2 * scores.nbytes / base / 1e6:.0f} GB/s for two reads)")
    for block in (256, 512, 1024, 2048):
        for warps in (4, 8):
            got = softmax_granule_sums(scores, 0, rows, granules, granule_tiles, block, warps)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
            t = ms(lambda: softmax_granule_sums(scores, 0, rows, granules, granule_tiles, block, warps))
            print(f"  block {block:5d} warps {warps}: {t:.3f} ms ({base / t:.2f}x)")
