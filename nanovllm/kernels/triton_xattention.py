"""XAttention's estimate in one Triton kernel: granule masses without the [heads, query tiles, key tiles] scores.

Queries and keys are cut into tiles of `stride` positions. The score of (query tile t, key tile u) is the
sum over j of q[t*S + j] . k[u*S + S-1-j] (the tile's antidiagonal), times 1/(sqrt(D)*S); each query tile
and head takes a softmax over its causally visible key tiles (u <= t), and the probabilities are summed
over the tiles of each (query granule, key granule). `XAttentionSelector.granule_mass`'s PyTorch path
(`antidiagonal_scores`, a softmax, one sum per granule) is the reference. `softmax_granule_sums` is the second
half of that path alone: the softmax and the granule sums of given scores, without writing probabilities.

The scores are a matrix product: viewed as [tiles, S * row stride], a tile's S rows side by side, the queries
and keys are its operands, the step over the S * D reduction taking query row j's columns and key row S-1-j's.
Both views are tensor descriptors over the tensors in place (a padded copy only where the rows do not fill
whole tiles), so the product runs on TMA loads like a GEMM. `_estimate_kernel`: one program per (block of
BLOCK_M query tiles, whole query granules; SPLIT_BLOCKS of its visible key blocks of BLOCK_N tiles, whole key
granules; query head), the last query tiles first: an online softmax (running max m and sum l per query tile)
and, per key block, each query tile's exp-sums per key granule relative to the running max of that moment,
written to a scratch [Hq, tiles, key granules] (granule/stride times smaller than the scores) with that max,
and the split's m and l at its end. Splitting a row's key blocks over programs lets the programs running
together share their query and key tiles in L2 (one program walking all of them re-read its queries from HBM
per key block: 0.74x the PyTorch path instead of 1.61x on an H100). `_estimate_epilogue_kernel`, per (block of
query tiles; query head): the splits' statistics merged, each block's sums rescaled by exp(m_block - m) / l,
the query tiles of each query granule summed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.sizes import cdiv
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

LOG2_E = tl.constexpr(1.4426950408889634)  # constexpr: read inside @triton.jit


@dataclass(frozen=True)
class EstimateConfig:
    """The estimate's launch: query and key tiles per block (rounded up to whole granules), key blocks per
    program (a row's key blocks split over programs, so that programs running together share their queries' and
    keys' tiles in L2), warps and pipeline stages of the reduction loop."""
    block_m: int = 128
    block_n: int = 256
    split_blocks: int = 2
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _fold_block(acc, m, l, t, kb, num_key_tiles, scale_log2, part_ptr, max_ptr, head, rows, stride_ph, stride_pr,
                stride_mh, stride_mr, TILES_PER_GRANULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key block kb's scores acc folded into the running max m and sum l of each query tile t; its exp-sums per
    key granule (relative to the new running max) and that max written to the scratch. Returns (m, l)."""
    KEY_GRANULES: tl.constexpr = BLOCK_N // TILES_PER_GRANULE
    u = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    visible = (u[None, :] <= t[:, None]) & (u < num_key_tiles)[None, :]
    s = tl.where(visible, acc * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: no NaN
    p = tl.exp2(s - shift[:, None])
    l = l * tl.exp2(m - shift) + tl.sum(p, axis=1)
    sums = tl.sum(tl.reshape(p, [BLOCK_M, KEY_GRANULES, TILES_PER_GRANULE]), axis=2)
    columns = kb * KEY_GRANULES + tl.arange(0, KEY_GRANULES)
    tl.store(part_ptr + head * stride_ph + rows[:, None] * stride_pr + columns[None, :], sums)
    tl.store(max_ptr + head * stride_mh + rows * stride_mr + kb, shift)
    return m_new, l


_ESTIMATE_INTS = ["seq_len", "first_row_tile", "num_blocks", "num_splits", "group", "q_row_stride", "k_row_stride",
                  "stride_ph", "stride_pr", "stride_mh", "stride_mr", "stride_sh", "stride_sr"]


# every integer unspecialised: lengths, strides and the group vary by sequence, chunk and model, and the engine's
# warm-up compiles the one variant its dtype, head_dim, stride and granule make
@triton.jit(do_not_specialize=_ESTIMATE_INTS)
def _estimate_kernel(
    q_desc, k_desc, part_ptr, max_ptr, split_max_ptr, split_sum_ptr, seq_len, first_row_tile, num_blocks, num_splits,
    group, q_row_stride, k_row_stride, stride_ph, stride_pr, stride_mh, stride_mr, stride_sh, stride_sr, scale_log2,
    STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
    TILES_PER_GRANULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """One (block of query tiles, split of SPLIT_BLOCKS key blocks; query head): per key block the scores'
    exp-sums per key granule relative to the running max of that moment, with that max; the split's running max
    and sum per query tile at its end."""
    block = num_blocks - 1 - tl.program_id(0) // num_splits  # the last query tiles see the most keys: first
    split = tl.program_id(0) % num_splits
    head = tl.program_id(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # query tiles, counted from the chunk's first
    t = first_row_tile + rows
    num_key_tiles = (seq_len + STRIDE - 1) // STRIDE
    q_column = head * HEAD_DIM
    k_column = (head // group) * HEAD_DIM + (STRIDE - 1) * k_row_stride  # key row S-1 pairs with query row 0
    last_tile = tl.minimum(first_row_tile + block * BLOCK_M + BLOCK_M - 1, num_key_tiles - 1)
    PARTS: tl.constexpr = HEAD_DIM // BLOCK_K
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    kb_lo = split * SPLIT_BLOCKS
    kb_hi = tl.minimum(kb_lo + SPLIT_BLOCKS, last_tile // BLOCK_N + 1)
    for kb in range(kb_lo, kb_hi):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step in tl.range(STRIDE * PARTS, num_stages=NUM_STAGES):
            j = step // PARTS
            part = (step % PARTS) * BLOCK_K
            q = q_desc.load([block * BLOCK_M, q_column + j * q_row_stride + part])
            k = k_desc.load([kb * BLOCK_N, k_column - j * k_row_stride + part])
            acc = tl.dot(q, k.T, acc, input_precision=PRECISION)
        m, l = _fold_block(acc, m, l, t, kb, num_key_tiles, scale_log2, part_ptr, max_ptr, head, rows,
                           stride_ph, stride_pr, stride_mh, stride_mr, TILES_PER_GRANULE, BLOCK_M, BLOCK_N)
    tl.store(split_max_ptr + head * stride_sh + rows * stride_sr + split, m)
    tl.store(split_sum_ptr + head * stride_sh + rows * stride_sr + split, l)


@triton.jit(do_not_specialize=["seq_len", "start", "first_row_tile", "row_tiles", "num_granules", "num_blocks",
                               "stride_oh", "stride_or", "stride_ph", "stride_pr", "stride_mh", "stride_mr",
                               "stride_sh", "stride_sr"])
def _estimate_epilogue_kernel(
    out_ptr, part_ptr, max_ptr, split_max_ptr, split_sum_ptr, seq_len, start, first_row_tile, row_tiles,
    num_granules, num_blocks, stride_oh, stride_or, stride_ph, stride_pr, stride_mh, stride_mr, stride_sh,
    stride_sr, STRIDE: tl.constexpr, TILES_PER_GRANULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
):
    """One (block of query tiles; query head): the splits' maxima and sums merged into each query tile's softmax
    statistics, every key block's exp-sums rescaled by them, the query tiles of each query granule summed."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = first_row_tile + rows
    num_key_tiles = (seq_len + STRIDE - 1) // STRIDE
    row_ok = (rows < row_tiles) & (t >= start // STRIDE) & (t < num_key_tiles)
    last_tile = tl.minimum(first_row_tile + block * BLOCK_M + BLOCK_M - 1, num_key_tiles - 1)
    key_blocks = last_tile // BLOCK_N + 1
    stats = head * stride_sh + rows * stride_sr
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(tl.cdiv(key_blocks, SPLIT_BLOCKS)):
        m = tl.maximum(m, tl.load(split_max_ptr + stats + split))
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK_M], tl.float32)
    for split in range(tl.cdiv(key_blocks, SPLIT_BLOCKS)):
        l += tl.load(split_sum_ptr + stats + split) * tl.exp2(tl.load(split_max_ptr + stats + split) - m)
    weight = tl.where(row_ok & (l > 0), 1.0 / tl.where(l > 0, l, 1.0), 0.0)
    KEY_GRANULES: tl.constexpr = BLOCK_N // TILES_PER_GRANULE
    QUERY_GRANULES: tl.constexpr = BLOCK_M // TILES_PER_GRANULE
    granules = tl.arange(0, KEY_GRANULES)
    query_granules = block * QUERY_GRANULES + tl.arange(0, QUERY_GRANULES)
    for kb in range(key_blocks):
        g = kb * KEY_GRANULES + granules
        sums = tl.load(part_ptr + head * stride_ph + rows[:, None] * stride_pr + g[None, :])
        m_then = tl.load(max_ptr + head * stride_mh + rows * stride_mr + kb)
        scaled = sums * (tl.exp2(m_then - m) * weight)[:, None]
        mass = tl.sum(tl.reshape(scaled, [QUERY_GRANULES, TILES_PER_GRANULE, KEY_GRANULES]), axis=1)
        tl.store(out_ptr + head * stride_oh + query_granules[:, None] * stride_or + g[None, :], mass,
                 mask=(query_granules < row_tiles // TILES_PER_GRANULE)[:, None] & (g < num_granules)[None, :])


@functools.cache
def estimate_config(device: torch.device) -> EstimateConfig:
    """The default launch where the device's shared memory per block holds its three stages of 128 x 64 query
    and 256 x 64 key tiles (Hopper's 227 KB), else 128 x 128 tiles in two stages."""
    if device.type == "cuda" and getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin",
                                         0) < 160 * 1024:
        return EstimateConfig(block_n=128, split_blocks=4, num_stages=2)
    return EstimateConfig()


def estimate_applies(q: torch.Tensor, stride: int, granule: int) -> bool:
    """The kernel takes these: the stride and tiles per granule powers of two, a head_dim of 16-256 whose
    reduction steps (`_block_k`) divide it, 16- or 32-bit queries."""
    head_dim, tiles = q.shape[-1], granule // stride
    powers = not (stride & (stride - 1) or tiles & (tiles - 1))
    return powers and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and 16 <= head_dim <= 256 and \
        head_dim % _block_k(q) == 0


def _block_k(q: torch.Tensor) -> int:
    """Columns per reduction step: 128 bytes of a row (TMA's swizzled width), at most the head_dim."""
    return min(128 // q.element_size(), 1 << (q.shape[-1].bit_length() - 1))


def tile_rows(x: torch.Tensor, front: int, stride: int) -> tuple[torch.Tensor, int]:
    """x [n, H, D] as rows of `stride` positions side by side ([tiles, stride * row stride] with `front` zero
    positions first and zeros after the last to whole tiles) and that row stride: x itself where it is laid out
    so (no zeros to add, heads of D contiguous columns, 16-byte aligned), else a padded copy."""
    n, heads, dim = x.shape
    aligned = x.stride(2) == 1 and x.stride(1) == dim and x.stride(0) * x.element_size() % 16 == 0 and \
        x.data_ptr() % 16 == 0
    if front or n % stride or not aligned:
        x = F.pad(x.reshape(n, heads * dim), (0, 0, front, -(front + n) % stride))
    return x, x.stride(0)


def _descriptor(rows: torch.Tensor, row_stride: int, stride: int, block_rows: int, block_k: int) -> TensorDescriptor:
    tiles = -(-rows.shape[0] // stride)
    return TensorDescriptor(rows, [tiles, stride * row_stride], [stride * row_stride, 1], [block_rows, block_k])


def estimate_granule_mass(q: torch.Tensor, keys: torch.Tensor, stride: int, granule: int, lo: int, hi: int,
                          config: EstimateConfig | None = None) -> torch.Tensor:
    """[Hq, query granules of [lo, hi), key granules of seq_len] float32 estimated masses. q [n_q, Hq, D] are
    the last n_q of the seq_len positions of keys [seq_len, Hk, D]; lo is a multiple of the granule, hi one
    or seq_len; `estimate_applies` holds. config: `estimate_config`'s where None."""
    config = config or estimate_config(q.device)
    n_q, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = keys.shape[:2]
    start = seq_len - n_q
    first = max(lo, start)
    q_rows, q_row_stride = tile_rows(q[first - start : hi - start], first - lo, stride)
    k_rows, k_row_stride = tile_rows(keys[:hi], 0, stride)
    tiles_per_granule = granule // stride
    block_m = max(config.block_m, tiles_per_granule, 16)  # tl.dot's smallest shape is 16
    block_n = max(config.block_n, tiles_per_granule, 16)
    rows = -(-(hi - lo) // granule)
    num_granules = -(-seq_len // granule)
    num_blocks, key_blocks = cdiv(rows * tiles_per_granule, block_m), cdiv(-(-hi // stride), block_n)
    num_splits = cdiv(key_blocks, config.split_blocks)
    scratch = dict(dtype=torch.float32, device=q.device)
    out = torch.zeros(num_heads, rows, num_granules, **scratch)
    part = torch.empty(num_heads, num_blocks * block_m, key_blocks * (block_n // tiles_per_granule), **scratch)
    running_max = torch.empty(num_heads, num_blocks * block_m, key_blocks, **scratch)
    split_max, split_sum = (torch.empty(num_heads, num_blocks * block_m, num_splits, **scratch) for _ in range(2))
    block_k = _block_k(q)
    _estimate_kernel[(num_blocks * num_splits, num_heads)](
        _descriptor(q_rows, q_row_stride, stride, block_m, block_k),
        _descriptor(k_rows, k_row_stride, stride, block_n, block_k), part, running_max, split_max, split_sum, seq_len,
        lo // stride, num_blocks, num_splits, num_heads // num_kv_heads, q_row_stride, k_row_stride, part.stride(0),
        part.stride(1), running_max.stride(0), running_max.stride(1), split_max.stride(0), split_max.stride(1),
        LOG2_E.value / (math.sqrt(head_dim) * stride), STRIDE=stride, HEAD_DIM=head_dim, BLOCK_K=block_k,
        TILES_PER_GRANULE=tiles_per_granule, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_BLOCKS=config.split_blocks,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    _estimate_epilogue_kernel[(num_blocks, num_heads)](
        out, part, running_max, split_max, split_sum, seq_len, start, lo // stride, rows * tiles_per_granule,
        num_granules, num_blocks, out.stride(0), out.stride(1), part.stride(0), part.stride(1),
        running_max.stride(0), running_max.stride(1), split_max.stride(0), split_max.stride(1), STRIDE=stride,
        TILES_PER_GRANULE=tiles_per_granule, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_BLOCKS=config.split_blocks,
        num_warps=4,
    )
    return out


@triton.jit(do_not_specialize=["num_tiles", "num_columns", "lead", "key_granules", "stride_sh", "stride_st",
                               "stride_oh", "stride_or"])  # lengths vary by chunk
def _softmax_granule_sums_kernel(
    scores_ptr, out_ptr, num_tiles, num_columns, lead, key_granules, stride_sh, stride_st, stride_oh, stride_or,
    TILES_PER_GRANULE: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (head, query granule): its tile rows' softmax statistics in a first pass over the row, then the
    probabilities summed per key granule in a second; rows outside [0, num_tiles) count zero."""
    head = tl.program_id(0)
    granule = tl.program_id(1)
    t = granule * TILES_PER_GRANULE - lead + tl.arange(0, TILES_PER_GRANULE)
    row_ok = (t >= 0) & (t < num_tiles)
    rows = scores_ptr + head.to(tl.int64) * stride_sh + t.to(tl.int64)[:, None] * stride_st
    offs = tl.arange(0, BLOCK_C)
    m = tl.full([TILES_PER_GRANULE], float("-inf"), tl.float32)
    total = tl.zeros([TILES_PER_GRANULE], tl.float32)
    for start in range(0, num_columns, BLOCK_C):
        cols = start + offs
        s = tl.load(rows + cols[None, :], mask=row_ok[:, None] & (cols < num_columns)[None, :],
                    other=float("-inf")).to(tl.float32) * LOG2_E
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
        total = total * tl.exp2(m - shift) + tl.sum(tl.exp2(s - shift[:, None]), axis=1)
        m = m_new
    shift = tl.where(m == float("-inf"), 0.0, m)
    counted = row_ok & (total > 0)
    weight = tl.where(counted, 1.0 / tl.where(counted, total, 1.0), 0.0)
    GRANULES: tl.constexpr = BLOCK_C // TILES_PER_GRANULE
    for start in range(0, num_columns, BLOCK_C):
        cols = start + offs
        s = tl.load(rows + cols[None, :], mask=row_ok[:, None] & (cols < num_columns)[None, :],
                    other=float("-inf")).to(tl.float32) * LOG2_E
        column_mass = tl.sum(tl.exp2(s - shift[:, None]) * weight[:, None], axis=0)
        mass = tl.sum(tl.reshape(column_mass, [GRANULES, TILES_PER_GRANULE]), axis=1)
        g = start // TILES_PER_GRANULE + tl.arange(0, GRANULES)
        tl.store(out_ptr + head.to(tl.int64) * stride_oh + granule * stride_or + g, mass, mask=g < key_granules)


def softmax_granule_sums(scores: torch.Tensor, lead: int, rows: int, key_granules: int, tiles_per_granule: int,
                         block_columns: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """[H, rows, key_granules] float32: the softmax over each row of scores [H, tiles, columns] (-inf: hidden),
    summed over the tiles of each (query granule, key granule); query granule r holds the rows
    r * tiles_per_granule - lead onwards, key granule g the columns g * tiles_per_granule onwards, and rows or
    columns past the scores count zero. What `XAttentionSelector.granule_mass` makes from the probabilities
    (softmax, zero padding, one sum per granule), in two reads of the scores and no write of their size.
    block_columns: columns a program reads per loop step; 1,024 ran 1.41-1.45x faster than 256 on an H100 over one
    8K-query chunk's scores at 32K and 128K keys (docs/results/fortieth/sums_tune.py)."""
    heads, num_tiles, num_columns = scores.shape
    if scores.stride(2) != 1:
        raise ValueError("scores must have contiguous rows")
    if tiles_per_granule & (tiles_per_granule - 1):
        raise ValueError(f"tiles per granule must be a power of two, got {tiles_per_granule}")
    block_c = max(block_columns, tiles_per_granule)
    out = torch.empty(heads, rows, key_granules, dtype=torch.float32, device=scores.device)
    _softmax_granule_sums_kernel[(heads, rows)](
        scores, out, num_tiles, num_columns, lead, key_granules, scores.stride(0), scores.stride(1), out.stride(0),
        out.stride(1), TILES_PER_GRANULE=tiles_per_granule, BLOCK_C=block_c, num_warps=num_warps,
    )
    return out
