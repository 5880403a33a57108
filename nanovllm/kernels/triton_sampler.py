"""Temperature sampling in one read of the logits (Triton).

A row's vocabulary is cut into `splits` ranges of whole chunks, one program each (enough programs to fill the GPU
at any batch: one per row left small batches a few programs streaming 150K entries each). A program streams its
range in chunks and keeps the running argmax of logits / T + Gumbel noise, the noise drawn in the kernel from
Philox (`tl.rand4x`, four entries a call) with the row's seed at each entry's index, so the draw does not depend
on the split; the splits' maxima are then reduced on the host's stream (the first maximum wins). argmax(x / T + G) with
G = -log(-log U) picks token i with probability softmax(x / T)_i, the same distribution as `layers.sampler`'s
exponential race; rows with T = 0 take the plain argmax (the first maximum, as torch.argmax). The PyTorch sampler
is the reference; this replaces its four or five passes over [B, V] float32 (scale, noise, log, subtract,
argmax) on large decode batches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.sizes import cdiv, num_sms
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

CHUNK = 2048
PROGRAMS_PER_SM = 4  # a launch aims for this many programs per SM, vocabulary ranges of whole chunks permitting


@triton.jit
def _race(base, offs, hi, u, sampled, scale, best, best_idx):
    """One sub-block of a chunk into the lanes' running maxima (logits / T + Gumbel noise from u)."""
    x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
    u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)  # -log(-log u) finite
    x = tl.where(sampled, x * scale - tl.log(-tl.log(u)), x)
    better = x > best  # strict: an earlier entry of the lane keeps a tie, as the first maximum
    return tl.where(better, x, best), tl.where(better, offs, best_idx)


@triton.jit(do_not_specialize=["per_split"])
def _sample_kernel(logits_ptr, temps_ptr, seeds_ptr, values_ptr, indices_ptr, vocab, stride, per_split,
                   CHUNK: tl.constexpr):
    """Program (row, split): the maximum of the row's entries [split * per_split, +per_split) and its first index
    into values / indices [rows, splits]. One Philox call draws the noise of four entries, a quarter chunk apart
    (its counter: the chunk's start / 4 + the lane), so the noise of an entry depends on its index and CHUNK only."""
    QUARTER: tl.constexpr = CHUNK // 4
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    sampled = temp > 0.0
    scale = 1.0 / tl.where(sampled, temp, 1.0)
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride
    lo = split * per_split
    hi = tl.minimum(lo + per_split, vocab)
    lanes = tl.arange(0, QUARTER)
    best = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([QUARTER], dtype=tl.int32)
    for start in range(lo, hi, CHUNK):
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
        offs = start + lanes
        best, best_idx = _race(base, offs, hi, u0, sampled, scale, best, best_idx)
        best, best_idx = _race(base, offs + QUARTER, hi, u1, sampled, scale, best, best_idx)
        best, best_idx = _race(base, offs + 2 * QUARTER, hi, u2, sampled, scale, best, best_idx)
        best, best_idx = _race(base, offs + 3 * QUARTER, hi, u3, sampled, scale, best, best_idx)
    top = tl.max(best, 0)
    # the smallest index among lanes holding the maximum
    idx = tl.min(tl.where(best == top, best_idx, vocab), 0)
    out = row * tl.num_programs(1) + split
    tl.store(values_ptr + out, top)
    tl.store(indices_ptr + out, idx)


def vocab_splits(batch: int, vocab: int, chunk: int, num_sms: int) -> tuple[int, int]:
    """(splits, entries per split, a multiple of chunk): PROGRAMS_PER_SM programs per SM over the batch, at most
    one chunk of the vocabulary each, no split empty."""
    return _ranges(vocab, max(1, min(cdiv(vocab, chunk), cdiv(PROGRAMS_PER_SM * num_sms, max(batch, 1)))), chunk)


def _ranges(vocab: int, splits: int, chunk: int) -> tuple[int, int]:
    """(splits, entries per split): at most `splits` ranges of whole chunks covering the vocabulary, none empty."""
    per_split = cdiv(cdiv(vocab, splits), chunk) * chunk
    return cdiv(vocab, per_split), per_split


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, chunk: int = CHUNK,
                  splits: int | None = None) -> torch.Tensor:
    """logits [B, V] (float32 or 16-bit); temperatures float32 [B] (0: greedy); seeds int64 [B] (Philox
    keys, non-negative); chunk: vocabulary entries per loop iteration (a power of two, at least 4); splits:
    programs per row (default `vocab_splits`; the tokens do not depend on it). Returns int64 [B]."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("logits must be [B, V] with contiguous rows")
    batch, vocab = logits.shape
    if not batch:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    splits, per_split = vocab_splits(batch, vocab, chunk, num_sms(logits.device)) if splits is None else \
        _ranges(vocab, splits, chunk)
    values = torch.empty(batch, splits, dtype=torch.float32, device=logits.device)
    indices = torch.empty(batch, splits, dtype=torch.int32, device=logits.device)
    _sample_kernel[(batch, splits)](logits, temperatures, seeds, values, indices, vocab, logits.stride(0),
                                    per_split, CHUNK=chunk, num_warps=8)
    if splits == 1:
        return indices[:, 0].long()
    return indices.gather(1, values.argmax(1, keepdim=True))[:, 0].long()  # argmax: the first maximum
