"""Temperature sampling in one read of the logits (Triton).

Each program takes one row: it streams the vocabulary in chunks and keeps the running argmax of
logits / T + Gumbel noise, the noise drawn in the kernel from Philox (`tl.rand`) with the row's seed.
argmax(x / T + G) with G = -log(-log U) picks token i with probability softmax(x / T)_i, the same
distribution as `layers.sampler`'s exponential race; rows with T = 0 take the plain argmax (the first
maximum, as torch.argmax). The PyTorch sampler is the reference; this replaces its four or five passes
over [B, V] float32 (scale, noise, log, subtract, argmax) on large decode batches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

CHUNK = 2048


@triton.jit
def _sample_kernel(logits_ptr, temps_ptr, seeds_ptr, out_ptr, vocab, stride, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temps_ptr + row)
    sampled = temp > 0.0
    scale = 1.0 / tl.where(sampled, temp, 1.0)
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride
    best = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(0, vocab, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, offs)
        u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)  # -log(-log u) finite
        x = tl.where(sampled, x * scale - tl.log(-tl.log(u)), x)
        better = x > best  # strict: an earlier chunk keeps a tie, as the first maximum
        best = tl.where(better, x, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, 0)
    # the smallest index among lanes holding the maximum
    idx = tl.min(tl.where(best == top, best_idx, vocab), 0)
    tl.store(out_ptr + row, idx)


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, chunk: int = CHUNK
                  ) -> torch.Tensor:
    """logits [B, V] (float32 or 16-bit); temperatures float32 [B] (0: greedy); seeds int64 [B] (Philox
    keys, non-negative); chunk: vocabulary entries per loop iteration (a power of two). Returns int64 [B]."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("logits must be [B, V] with contiguous rows")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int32, device=logits.device)
    if batch:
        _sample_kernel[(batch,)](logits, temperatures, seeds, out, vocab, logits.stride(0), CHUNK=chunk, num_warps=8)
    return out.long()
