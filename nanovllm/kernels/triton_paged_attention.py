"""Triton kernels for attention over the paged KV cache: split-KV decode and varlen chunked prefill.

Layouts are those of `nanovllm.kernels.reference` (which defines the expected results):
q [T, Hq, D], caches [num_blocks, block_size, Hk, D], cu_query_lens [B + 1], seq_lens [B],
block_tables [B, max_blocks]. Both entry points return (out [T, Hq, D] in q.dtype, lse [T, Hq] float32,
natural log). Softmax runs online in float32 in base 2 (scores pre-multiplied by log2(e)). With
accumulate=True both merge their result by log-sum-exp into the partial result already in `out` (CPU
offload attends over host-resident pieces one at a time this way).

KV tiles: a KV tile is BLOCK_N consecutive positions with BLOCK_N dividing block_size, so a tile never
straddles two cache blocks: one block-table load per tile, then contiguous rows of that block.

Decode (every sequence has one new token): grid (B, Hk, num_splits). A program takes one sequence,
one KV head and all GROUP = Hq / Hk query heads that share it (K/V read once for the group, padded
to >= 16 rows for tl.dot), and a contiguous range of that sequence's KV tiles: its tiles are cut into
num_splits ranges of cdiv(tiles, num_splits), so a split may be empty: it returns at once, writing nothing
(a graph's splits follow its tables' width, max_model_len, not the step's lengths: at 1K of 32K most are empty).
Splits write float32 partials [B, Hq, S, D] / [B, Hq, S]; `_merge_splits_kernel` (grid (B, Hq)) combines those
with tiles (their count follows from the length) by log-sum-exp into the token's row. With one split the kernel
writes the final output directly. The number of splits depends only on shapes (batch, Hk, block_tables width *
block_size, SM count), never on data, so the decode path never synchronises with the host and can be captured in a
CUDA graph. A launch of one split reads 128-key tiles where K rows allow (`one_split_tile_size`), else 64.
With seq_ids, program i serves sequence seq_ids[i]: the one-token rows of a mixed batch.

Prefill (any query lengths, with or without a cached prefix): grid (Hq, num_work). The host builds
a small int32 schedule [num_work, 2] of (sequence, query tile of BLOCK_M rows) pairs from the
query lengths (a Python list, so no device sync), costliest tiles first. A program loads its
BLOCK_M query rows of one head and walks the KV tiles up to its last row's position: tiles every
row fully sees run without masks, the few on the diagonal with the causal mask. Grid axis 1 allows
65535 work items (8M tokens at BLOCK_M = 128).

head_dim must be a power of two (16..256); block_size a multiple of 16.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
try:  # Triton >= 3.4; older ones load K/V through pointers only
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - the pinned Triton has it
    TensorDescriptor = None

from nanovllm.kernels import dependent_launch
from nanovllm.kernels.dependent_launch import let_next_start, prefetch_l2, wait_for_previous
from nanovllm.kernels.reference import HostKV
from nanovllm.kernels.sizes import next_power_of_2, num_sms
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

_LOG2E = 1.4426950408889634
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

MIN_TILES_PER_SPLIT = 4  # a decode split reads at least this many KV tiles (when the bound allows)
MAX_SPLITS = 64
WAVES = 4  # decode aims for this many programs per SM
# From ONE_SPLIT_WAVES waves of programs a decode step takes one split: the kernel writes its result, no merge. The
# H200's bench/tune_decode.py at batch 32 x 1K of the Llama-3.1-8B shape (256 programs): 40 us in one split, 44 in
# the three splits four waves made (and 5.89 vs 6.17 ms a step); batch 1 at 32K wants its 64 splits (41 vs 45 us
# in 32).
ONE_SPLIT_WAVES = 1.8
SPLITS_PAD: tl.constexpr = tl.constexpr(MAX_SPLITS)  # the merge reads every split's slot in one pass (masked)
# a decode split of at most this many KV tiles is prefetched into L2 before its dependent launch waits (EARLY)
EARLY_TILES: tl.constexpr = tl.constexpr(2)
# decode reading pinned host memory in place: bench/tune_host_decode.py on the H200 (80 / 160 16-token pages
# per KV head, batch 1 and 4) had 16 splits fastest everywhere, 1.55x one tile per split (64) at 80 pages
HOST_READ_SPLITS = 16




@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pos, seq_len, k_head_ptr, v_head_ptr, table_ptr, tile_lo, tile_hi, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, host_k_delta, host_v_delta, host_base,
    code_head_ptr, scale_head_ptr, stride_cb, stride_ct, stride_sb, stride_st,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, HOST_KV: tl.constexpr, KEY_CODES: tl.constexpr = False,
):
    """Online-softmax update of (acc, m_i, l_i) with KV tiles [tile_lo, tile_hi) of one sequence.

    MASKED applies the causal mask (key pos <= q_pos) and the end of the sequence (pos < seq_len);
    unmasked tiles must be fully visible to every row. m_i is in log2 units. HOST_KV: table entries
    >= host_base are blocks of the host pool, host_*_delta elements away from the device caches.
    KEY_CODES (with HOST_KV): a host block's keys are int8 codes times a scale per token, read from the
    device (code/scale head pointers, host block (entry - host_base)), and only its values from the host;
    q . codes runs in q's dtype (the codes are exact in it), scaled in float32.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_N
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int64)
        k_block = block * stride_kb
        v_block = block * stride_vb
        if HOST_KV:
            on_host = block >= host_base
            k_block = tl.where(on_host, host_k_delta + (block - host_base) * stride_kb, k_block)
            v_block = tl.where(on_host, host_v_delta + (block - host_base) * stride_vb, v_block)
        rows = start % BLOCK_SIZE + offs_n  # rows of this cache block
        k_ptrs = k_head_ptr + k_block + rows[None, :] * stride_kt + offs_d[:, None]  # K^T [D, BLOCK_N]
        v_ptrs = v_head_ptr + v_block + rows[:, None] * stride_vt + offs_d[None, :]  # V [BLOCK_N, D]
        k_pos = start + offs_n
        in_seq = k_pos < seq_len
        if not MASKED:
            in_seq = in_seq | True  # unmasked tiles are whole
        if KEY_CODES:
            on_host = block >= host_base
            host_block = tl.where(on_host, block - host_base, 0)
            c_ptrs = code_head_ptr + host_block * stride_cb + rows[None, :] * stride_ct + offs_d[:, None]
            codes = tl.load(c_ptrs, mask=in_seq[None, :] & on_host, other=0)
            scales = tl.load(scale_head_ptr + host_block * stride_sb + rows * stride_st, mask=in_seq & on_host,
                             other=0.0)
            k = tl.load(k_ptrs, mask=in_seq[None, :] & (block < host_base), other=0.0)
            k = tl.where(on_host, codes.to(k.dtype), k)  # codes are exact in 16 bits; the scale goes on q . k
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
        elif MASKED:
            k = tl.load(k_ptrs, mask=in_seq[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, k, input_precision=PRECISION)
        if KEY_CODES:
            qk = qk * tl.where(on_host, scales, 1.0)[None, :]
        if MASKED:
            qk = tl.where((k_pos[None, :] <= q_pos[:, None]) & in_seq[None, :], qk, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, qk, v, qk_scale, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attend_tiles_tma(
    acc, m_i, l_i, q, q_pos, seq_len, k_desc, v_desc, table_ptr, head_col, tile_lo, tile_hi, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """`_attend_tiles` of device-resident caches read through tensor descriptors (TMA on Hopper): the
    caches viewed as [blocks * BLOCK_SIZE, Hk * D], a tile at (block row, head_col). Rows past the end of
    the sequence are masked after the load (their values may be anything, NaN included)."""
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_N
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int32)  # descriptors take int32 offsets
        row = block * BLOCK_SIZE + start % BLOCK_SIZE
        k = k_desc.load([row, head_col])
        v = v_desc.load([row, head_col])
        qk = tl.dot(q, k.T, input_precision=PRECISION)
        if MASKED:
            k_pos = start + offs_n
            in_seq = k_pos < seq_len
            qk = tl.where((k_pos[None, :] <= q_pos[:, None]) & in_seq[None, :], qk, float("-inf"))
            v = tl.where(in_seq[:, None], v, 0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, qk, v, qk_scale, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _online_softmax_step(acc, m_i, l_i, qk, v, qk_scale, PRECISION: tl.constexpr):
    """Fold one tile's raw scores q.k (masked ones -inf) and values v into the running (acc, m_i, l_i);
    qk_scale (> 0) takes q.k to log2 units, applied in the exponent's fused multiply-add."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _finish(acc, m_i, l_i):
    """Normalised output and natural-log lse; rows that saw no key give 0 and -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    return out, lse


@triton.jit
def _lse_weights(prev_lse, lse):
    """Weights of two normalised partial results with these log-sum-exps (any shape; -inf: no keys,
    weight 0) and the merged lse. Both empty: weights 0, lse -inf."""
    peak = tl.maximum(prev_lse, lse)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # both empty: avoid -inf - -inf
    w_prev = tl.exp(prev_lse - peak)
    w_new = tl.exp(lse - peak)
    total = w_prev + w_new
    norm = tl.where(total > 0.0, total, 1.0)
    return w_prev / norm, w_new / norm, peak + tl.log(total)


@triton.jit
def _merge_stored(out, lse, out_ptrs, lse_ptrs, row_mask):
    """Log-sum-exp merge of this part (out [R, D] normalised, lse [R] natural log) with the partial
    result stored at out_ptrs / lse_ptrs; a side with lse -inf has no keys and its out is ignored."""
    prev_lse = tl.load(lse_ptrs, mask=row_mask, other=float("-inf"))
    prev_out = tl.load(out_ptrs, mask=row_mask[:, None], other=0.0).to(tl.float32)
    w_prev, w_new, merged_lse = _lse_weights(prev_lse, lse)
    merged = tl.where(w_prev[:, None] > 0.0, prev_out * w_prev[:, None], 0.0) + \
        tl.where(w_new[:, None] > 0.0, out * w_new[:, None], 0.0)
    return merged, merged_lse


@triton.jit
def _prefetch_tiles(table_ptr, tile_lo, tile_hi, k_head_ptr, v_head_ptr, stride_kb, stride_kt, stride_vb, stride_vt,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """L2 prefetch hints (`prefetch.global.L2`, no registers, nothing waited for) for the K and V rows of KV tiles
    [tile_lo, tile_hi) of a device-resident cache, one hint per 64 elements of a row."""
    LINES: tl.constexpr = (HEAD_DIM + 63) // 64
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, LINES) * 64
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_N
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int64)
        rows = start % BLOCK_SIZE + offs_n
        k_ptrs = k_head_ptr + block * stride_kb + rows[:, None] * stride_kt + offs_l[None, :]
        v_ptrs = v_head_ptr + block * stride_vb + rows[:, None] * stride_vt + offs_l[None, :]
        prefetch_l2(k_ptrs)
        prefetch_l2(v_ptrs)


# Scalar arguments that change from step to step (table widths, split counts) are not specialised on (== 1,
# divisible by 16): a new value must not compile a new variant on the request path. The host-pool offsets
# stay specialised: fixed for the engine's life (multiples of a block), they keep KV loads vectorised.
@triton.jit(do_not_specialize=["num_splits", "stride_lt", "stride_lh", "stride_bt", "stride_bh"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, cu_ptr, seq_lens_ptr, tables_ptr, seq_ids_ptr, qk_scale,
    num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, host_k_delta, host_v_delta,
    host_base, stride_bh, codes_ptr, scales_ptr, stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, INDEXED: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr, HOST_KV: tl.constexpr, PER_HEAD: tl.constexpr, KEY_CODES: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """One (sequence, KV head, split). INDEXED: program i serves sequence seq_ids[i], else sequence i.
    DIRECT (one split): write the result at the token's row of out/lse (ACCUMULATE: merged by LSE with
    what the row holds), else partials at [i, head, split]. PER_HEAD: each KV head has its own block
    table row and KV length (tables [B, Hk, max_blocks], seq_lens [B, Hk]: block-sparse selections).
    PDL: a dependent launch; it waits before reading q, the caches or anything else a previous kernel may write.
    EARLY (with PDL): the lengths, the block tables and seq_ids come from the host, not from a kernel, so they are
    read before the wait, and a split of at most EARLY_TILES tiles is prefetched into L2 (a hint: L2 is coherent, so
    a line the previous kernel is still writing reads its new value later): the waiting overlaps the previous
    kernel."""
    let_next_start(PDL)
    if not EARLY:
        wait_for_previous(PDL)
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if INDEXED:
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    row = tl.load(cu_ptr + seq).to(tl.int64)
    if PER_HEAD:
        seq_len = tl.load(seq_lens_ptr + seq * tl.num_programs(1) + kv_head)  # seq_lens [B, Hk], contiguous
    else:
        seq_len = tl.load(seq_lens_ptr + seq)

    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    lo = split * per_split
    if not DIRECT:
        if lo >= num_tiles:  # an empty split: the merge reads only those with tiles
            return
    hi = tl.minimum(lo + per_split, num_tiles)
    full_tiles = seq_len // BLOCK_N  # tiles without positions past the end
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    if PER_HEAD:
        table += kv_head * stride_bh
    if EARLY:
        if hi - lo <= EARLY_TILES:  # a short split whole (longer ones: a prefetch ahead of the pipeline cost time)
            _prefetch_tiles(table, lo, hi, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
                            stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, HEAD_DIM)
        wait_for_previous(PDL)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask[:, None], other=0.0)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + seq_len - 1

    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    code_head = codes_ptr + kv_head * stride_ch
    scale_head = scales_ptr + kv_head * stride_sh
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, seq_len, k_head, v_head, table, lo, tl.minimum(hi, full_tiles), qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt, host_k_delta, host_v_delta, host_base,
        code_head, scale_head, stride_cb, stride_ct, stride_sb, stride_st,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, PRECISION, HOST_KV, KEY_CODES,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, seq_len, k_head, v_head, table, tl.maximum(lo, full_tiles), hi, qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt, host_k_delta, host_v_delta, host_base,
        code_head, scale_head, stride_cb, stride_ct, stride_sb, stride_st,
        BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, PRECISION, HOST_KV, KEY_CODES,
    )
    out, lse = _finish(acc, m_i, l_i)
    if DIRECT:
        dst = row
    else:
        dst = i.to(tl.int64)
    out_ptrs = out_ptr + dst * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    lse_ptrs = lse_ptr + dst * stride_lt + heads * stride_lh + split * stride_ls
    if ACCUMULATE and DIRECT:
        out, lse = _merge_stored(out, lse, out_ptrs, lse_ptrs, head_mask)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    tl.store(lse_ptrs, lse, mask=head_mask)


# What locates a row's length (flat [B] or per KV head [B, Hk], the group, the tile) is not specialised on: every
# decode path shares the merge variants the start-up compiled.
@triton.jit(do_not_specialize=["num_splits", "stride_plt", "stride_plh", "stride_ns", "stride_nh", "group", "block_n"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, cu_ptr, seq_ids_ptr, seq_lens_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_plt, stride_plh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_ns, stride_nh, group, block_n,
    HEAD_DIM: tl.constexpr, INDEXED: tl.constexpr, ACCUMULATE: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """Log-sum-exp merge of the splits of partials [i, head, :] that have tiles (the decode kernel's split rule on
    the sequence's length; the others wrote nothing) into the token's row of out/lse (ACCUMULATE: also with what
    that row holds). No split with tiles: out 0, lse -inf (ACCUMULATE: the row unchanged). One variant for every
    split count (with a second one padded to 16 splits, rows past 16 splits compiled the wide one on the request
    path). PDL: a dependent launch, waiting before any load (EARLY: before any load but of the host's lengths, rows
    and seq_ids, as in the decode kernel)."""
    let_next_start(PDL)
    if not EARLY:
        wait_for_previous(PDL)
    i = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if INDEXED:
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    row = tl.load(cu_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq * stride_ns + (head // group) * stride_nh)  # per KV head: stride_nh 1
    num_tiles = tl.cdiv(seq_len, block_n)
    with_tiles = tl.cdiv(num_tiles, tl.maximum(tl.cdiv(num_tiles, num_splits), 1))
    if EARLY:
        wait_for_previous(PDL)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < with_tiles
    part_lse = tl.load(part_lse_ptr + i * stride_plt + head * stride_plh + offs_s, mask=s_mask, other=float("-inf"))
    peak = tl.max(part_lse, 0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # a sequence without keys: all parts empty
    weight = tl.exp(part_lse - peak)
    total = tl.sum(weight, 0)
    parts = tl.load(part_out_ptr + i * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    out_dst = out_ptr + row * stride_ot + head * stride_oh + offs_d
    lse_dst = lse_ptr + row * stride_lt + head * stride_lh
    lse = peak + tl.log(total)
    if ACCUMULATE:
        prev_out = tl.load(out_dst).to(tl.float32)
        w_prev, w_new, lse = _lse_weights(tl.load(lse_dst), lse)
        out = tl.where(w_prev > 0.0, prev_out * w_prev, 0.0) + tl.where(w_new > 0.0, out * w_new, 0.0)
    tl.store(out_dst, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_dst, lse)


@triton.jit(do_not_specialize=["stride_lt", "stride_lh", "stride_bt", "stride_bh"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, cu_ptr, seq_lens_ptr, tables_ptr, schedule_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_bh, num_kv_heads,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
    ACCUMULATE: tl.constexpr, PER_HEAD: tl.constexpr, TMA: tl.constexpr, PACK: tl.constexpr, TILE: tl.constexpr,
):
    """PER_HEAD: each KV head has its own block table row and KV length (tables [B, Hk, max_blocks],
    seq_lens [B, Hk]): attention over a block-sparse selection, the dropped blocks preceding the queries.
    TMA: k_cache_ptr / v_cache_ptr are tensor descriptors of the caches viewed as [rows, Hk * D].
    PACK: a program serves a KV head's GROUP query heads, its BLOCK_M rows TILE = BLOCK_M // GROUP queries of
    each (row r: head r // TILE), so each K/V tile is loaded once for the group; else TILE = BLOCK_M queries of
    one head. TILE is the schedule's query tile."""
    work = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    if PACK:
        kv_head = tl.program_id(0)
        head = kv_head * GROUP + r // TILE  # each row's query head
        query = r % TILE
    else:
        head = tl.program_id(0)
        kv_head = head // GROUP
        query = r
    seq = tl.load(schedule_ptr + 2 * work)
    q_tile = tl.load(schedule_ptr + 2 * work + 1)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if PER_HEAD:
        seq_len = tl.load(seq_lens_ptr + seq * num_kv_heads + kv_head)
    else:
        seq_len = tl.load(seq_lens_ptr + seq)
    if CAUSAL:
        first_pos = seq_len - q_len + q_tile * TILE  # position of the tile's first query row
    else:  # the keys are history preceding every query: all visible
        first_pos = seq_len - 1

    offs_m = q_tile * TILE + query  # query rows within the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    row_mask = offs_m < q_len
    q_rows = rows * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    if CAUSAL:
        q_pos = seq_len - q_len + offs_m
    else:
        q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    if PER_HEAD:
        table += kv_head * stride_bh
    full_tiles = (first_pos + 1) // BLOCK_N  # every key of these tiles is <= first_pos
    all_tiles = tl.cdiv(tl.minimum(first_pos + TILE, seq_len), BLOCK_N)
    if TMA:
        acc, m_i, l_i = _attend_tiles_tma(
            acc, m_i, l_i, q, q_pos, seq_len, k_cache_ptr, v_cache_ptr, table, kv_head * HEAD_DIM, 0, full_tiles,
            qk_scale, BLOCK_SIZE, BLOCK_N, False, PRECISION,
        )
        acc, m_i, l_i = _attend_tiles_tma(
            acc, m_i, l_i, q, q_pos, seq_len, k_cache_ptr, v_cache_ptr, table, kv_head * HEAD_DIM, full_tiles,
            all_tiles, qk_scale, BLOCK_SIZE, BLOCK_N, True, PRECISION,
        )
    else:
        k_head = k_cache_ptr + kv_head * stride_kh
        v_head = v_cache_ptr + kv_head * stride_vh
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, seq_len, k_head, v_head, table, 0, full_tiles, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, 0, 0, 0, k_head, k_head, 0, 0, 0, 0,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, PRECISION, False,
        )
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, seq_len, k_head, v_head, table, full_tiles, all_tiles, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, 0, 0, 0, k_head, k_head, 0, 0, 0, 0,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, PRECISION, False,
        )
    out, lse = _finish(acc, m_i, l_i)
    out_ptrs = out_ptr + (rows * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    lse_ptrs = lse_ptr + rows * stride_lt + head * stride_lh
    if ACCUMULATE:
        out, lse = _merge_stored(out, lse, out_ptrs, lse_ptrs, row_mask)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    tl.store(lse_ptrs, lse, mask=row_mask)


# ----------------------------------------------------------------------------------------------
# Host side


def kv_tile_size(block_size: int, cap: int) -> int:
    """The largest power of two <= cap dividing block_size (a multiple of 16), so tiles stay in a block."""
    if block_size % 16:
        raise ValueError(f"block_size must be a multiple of 16, got {block_size}")
    tile = cap
    while block_size % tile:
        tile //= 2
    return tile


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): one from ONE_SPLIT_WAVES waves of programs, else enough programs for WAVES
    per SM, each split >= MIN_TILES_PER_SPLIT tiles of a max_seq_len sequence. A function of shapes only (CUDA-graph
    safe)."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= ONE_SPLIT_WAVES * num_sms:
        return 1
    max_tiles = -(-max_seq_len // block_n)
    by_length = max(1, max_tiles // MIN_TILES_PER_SPLIT)
    by_occupancy = -(-WAVES * num_sms // programs)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def decode_num_stages(num_programs: int, num_splits: int, indexed: bool, host_kv: bool) -> int:
    """Pipeline depth of a decode launch: 1 where one sequence's decode step over device KV is split (a split reads a
    few tiles and waits on their latency), else 2. H100, a batch-1 chain of q/k/v GEMV, attention and o GEMV in a
    CUDA graph of dependent launches (Llama-3.1-8B shape, docs/results/fortysecond/decode_early.py): 39.0 vs 40.0 us
    a layer at 1K, 82.2 vs 83.5 at 32K. Mixed steps' decode rows (indexed) and host-KV steps keep 2: untimed, and the
    variants the start-up compiles."""
    return 1 if num_programs == 1 and num_splits > 1 and not indexed and not host_kv else 2


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last (head_dim) dimension")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    seq_ids: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    accumulate: bool = False,
    host_kv: HostKV | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new token per sequence (at row cu_query_lens[i]) over its paged KV.

    seq_ids (int32/int64 [n], on the device): serve only these sequences, each with one new token
    (the decode rows of a mixed batch); rows of other sequences in `out` are left untouched.
    num_splits defaults to `decode_num_splits` of max_seq_len, itself defaulting to the bound
    block_tables.shape[1] * block_size, so it is fixed for fixed shapes. out: (out [T, Hq, D],
    lse [T, Hq] float32) to write into, else new tensors; accumulate=True merges the result by
    log-sum-exp with the partial result already in out (lse -inf: none). host_kv: table entries
    >= host_kv.base name blocks of its host caches (pinned memory, read in place through unified
    addressing: no copy). pdl: the decode and merge kernels as dependent launches (kernels/dependent_launch.py) where
    the device has them. num_stages defaults to `decode_num_stages`. Returns (out, lse)."""
    _check(q, k_cache, v_cache)
    host_args = _host_kv_args(host_kv, k_cache, v_cache)
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    per_head = _check_per_head(block_tables, seq_lens, num_kv_heads)
    num_programs = seq_lens.shape[0] if seq_ids is None else seq_ids.shape[0]
    tile = block_n or decode_tile_size(q.dtype, head_dim, block_size)
    if num_splits is None:
        bound = max_seq_len or block_tables.shape[-1] * block_size
        if host_kv is not None and host_kv.k.device.type == "cpu":
            num_splits = max(1, min(-(-bound // tile), HOST_READ_SPLITS))
        else:
            num_splits = decode_num_splits(num_programs, num_kv_heads, bound, tile, num_sms(q.device))
    if block_n is None and num_splits == 1 and host_kv is None:
        tile = one_split_tile_size(q.dtype, head_dim, block_size)
    block_n = tile
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} is outside 1..{MAX_SPLITS}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out, the partial result to merge into")
    out, lse = out or _new_outputs(q)
    if num_programs == 0:
        return out, lse
    if num_splits == 1:
        part_out, part_lse = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        part_out = torch.empty(num_programs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_programs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    indexed = seq_ids is not None
    num_stages = num_stages or decode_num_stages(num_programs, num_splits, indexed, host_kv is not None)
    ids = seq_ids if indexed else seq_lens  # an unused pointer when not indexed
    group = num_heads // num_kv_heads
    pdl = pdl and dependent_launch.supported(q.device)
    early = pdl and not per_head and host_kv is None  # lengths and tables from the host (EARLY in _decode_kernel)
    _decode_kernel[(num_programs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, cu_query_lens, seq_lens, block_tables, ids, scale * _LOG2E,
        num_splits, q.stride(0), q.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        *_cache_strides(k_cache, v_cache), block_tables.stride(0), *host_args,
        block_tables.stride(1) if per_head else 0, *_key_code_args(host_kv, k_cache),
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_N=block_n, INDEXED=indexed, DIRECT=num_splits == 1, PRECISION=_precision(q.dtype),
        ACCUMULATE=accumulate, HOST_KV=host_kv is not None, PER_HEAD=per_head,
        KEY_CODES=host_kv is not None and host_kv.key_codes is not None, PDL=pdl, EARLY=early, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_programs, num_heads)](
            part_out, part_lse, out, lse, cu_query_lens, ids, seq_lens, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            seq_lens.stride(0), seq_lens.stride(1) if per_head else 0, group, block_n,
            HEAD_DIM=head_dim, INDEXED=indexed, ACCUMULATE=accumulate, PDL=pdl, EARLY=early, num_warps=4,
            launch_pdl=pdl,
        )
    return out, lse


def _check_per_head(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int) -> bool:
    """True for per-KV-head tables [B, Hk, max_blocks] with lengths [B, Hk] (a block-sparse selection)."""
    if block_tables.dim() == 2 and seq_lens.dim() == 1:
        return False
    if block_tables.dim() != 3 or seq_lens.dim() != 2 or block_tables.shape[1] != num_kv_heads \
            or seq_lens.shape[1] != num_kv_heads or not seq_lens.is_contiguous():
        raise ValueError(f"per-head block tables need tables [B, {num_kv_heads}, blocks] and contiguous seq_lens "
                         f"[B, {num_kv_heads}]; got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    return True


def _host_kv_args(host_kv: HostKV | None, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(k delta, v delta, base): the host caches' offsets from the device caches, in elements."""
    if host_kv is None:
        return 0, 0, 0
    for host, cache in ((host_kv.k, k_cache), (host_kv.v, v_cache)):
        if host.dtype != cache.dtype or host.stride() != cache.stride() or host.shape[1:] != cache.shape[1:]:
            raise ValueError("host caches need the device caches' dtype, block shape and strides")
        if host.device != cache.device and not (cache.is_cuda and host.is_pinned()):
            raise ValueError("other caches read by a CUDA kernel must be on its device or in pinned host memory")
    size = k_cache.element_size()
    return ((host_kv.k.data_ptr() - k_cache.data_ptr()) // size, (host_kv.v.data_ptr() - v_cache.data_ptr()) // size,
            host_kv.base)


def _key_code_args(host_kv: HostKV | None, k_cache: torch.Tensor) -> tuple:
    """(codes, scales and their block, token and head strides) of the host blocks' key codes; unused
    placeholders without them."""
    if host_kv is None or host_kv.key_codes is None:
        return (k_cache, k_cache) + (0,) * 6
    codes, scales = host_kv.key_codes
    if codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.device != k_cache.device \
            or codes.shape[1:] != k_cache.shape[1:] or scales.shape != codes.shape[:3] or codes.stride(-1) != 1:
        raise ValueError(f"key codes need int8 codes {tuple(k_cache.shape[1:])} per block with float32 scales, on "
                         f"the caches' device; got {codes.dtype} {tuple(codes.shape)}, {scales.dtype} "
                         f"{tuple(scales.shape)}")
    return (codes, scales, *codes.stride()[:3], *scales.stride())


def _new_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per KV tile; divides the cache block size
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V tiles through tensor descriptors (Hopper's TMA; contiguous caches, else pointers)
    # a program's rows are the block_m // group queries of each query head of one KV head: a K/V tile loaded once for
    # the group (where group is a power of two dividing block_m; else one head per program)
    pack_heads: bool = False

    def packs(self, group: int) -> bool:
        return self.pack_heads and 1 < group <= self.block_m and self.block_m % group == 0 and not group & (group - 1)

    def tile_queries(self, group: int) -> int:
        """Queries per program, the schedule's query tile (build_prefill_schedule), for group query heads per KV
        head."""
        return self.block_m // group if self.packs(group) else self.block_m


def prefill_config(dtype: torch.dtype, head_dim: int, block_size: int, pack_heads: bool = False) -> PrefillConfig:
    """Tiles sized so that Q plus num_stages K/V tiles fit in an H100/H200's shared memory."""
    if dtype == torch.float32:  # 4-byte operands, no 16-bit tensor-core path: smaller tiles
        return PrefillConfig(64 if head_dim <= 128 else 32, kv_tile_size(block_size, 32), 4, 2, pack_heads=pack_heads)
    # bench/tune_prefill.py on the H200: descriptors 1.34-1.55x pointer loads at head_dim 128, 1.0-1.1x at 64
    if head_dim <= 64:
        return PrefillConfig(128, kv_tile_size(block_size, 128), 4, 2, tma=True, pack_heads=pack_heads)
    if head_dim <= 128:
        return PrefillConfig(128, kv_tile_size(block_size, 64), 4, 3, tma=True, pack_heads=pack_heads)
    return PrefillConfig(64, kv_tile_size(block_size, 64), 8, 2, pack_heads=pack_heads)


def decode_tile_size(dtype: torch.dtype, head_dim: int, block_size: int) -> int:
    """Keys per decode KV tile: 64, or 32 when a K row exceeds 512 bytes (float32 with head_dim 256)."""
    row_bytes = head_dim * dtype.itemsize
    return kv_tile_size(block_size, 64 if row_bytes <= 512 else 32)


def one_split_tile_size(dtype: torch.dtype, head_dim: int, block_size: int) -> int:
    """Keys per decode KV tile when each (sequence, KV head) is one program: 128 where a K row is at most 256 bytes
    (16-bit, head_dim <= 128), else `decode_tile_size`. On the H200 (bench/tune_decode.py, graph replays,
    2026-12-05) 128-key tiles at one split: the throughput workload's batch 256 161 vs 165 us, 113 147 vs 152, 48
    75.8 vs 78.7, 30 54.5 vs 66.1 (its batch 64 91 us with 64-key tiles was the one shape they did not lead);
    Llama-3.1-8B's batch 32 x 1K 37 vs 40 us."""
    if head_dim * dtype.itemsize > 256:
        return decode_tile_size(dtype, head_dim, block_size)
    return kv_tile_size(block_size, 128)


def build_prefill_schedule(
    query_lens: list[int],
    block_m: int,
    device: torch.device,
    seq_lens: list[int] | None = None,
    skip_single_token: bool = False,
) -> torch.Tensor:
    """int32 [num_work, 2]: the (sequence, query tile) each prefill program handles.

    Query tile t of sequence i covers its new tokens t*block_m ... (t+1)*block_m - 1. With seq_lens
    the costliest tiles (those seeing the most keys) come first, for load balance. skip_single_token
    leaves out sequences with one new token (served by the decode kernel instead)."""
    first = 2 if skip_single_token else 1
    work = [(i, t) for i, n in enumerate(query_lens) if n >= first for t in range(-(-n // block_m))]
    if seq_lens is not None:
        def keys_seen(item: tuple[int, int]) -> int:
            i, t = item
            return seq_lens[i] - query_lens[i] + min((t + 1) * block_m, query_lens[i])

        work.sort(key=keys_seen, reverse=True)
    return torch.tensor(work, dtype=torch.int32).reshape(-1, 2).to(device, non_blocking=True)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    schedule: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    causal: bool = True,
    accumulate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen causal attention of each sequence's new tokens over its cached prefix and themselves.
    With causal=False every new token sees all seq_lens[i] keys (KV history that precedes the queries).

    schedule must come from `build_prefill_schedule` with config.tile_queries(Hq // Hk); without it, it is built from
    cu_query_lens and seq_lens (a device-to-host copy); only the rows it covers are written. out:
    (out [T, Hq, D], lse [T, Hq] float32) to write into, else new tensors; accumulate=True merges the
    result by log-sum-exp with the partial result already in out. Returns (out, lse)."""
    _check(q, k_cache, v_cache)
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    per_head = _check_per_head(block_tables, seq_lens, num_kv_heads)
    config = config or prefill_config(q.dtype, head_dim, block_size)
    if block_size % config.block_n:
        raise ValueError(f"block_n={config.block_n} must divide block_size={block_size}")
    group = num_heads // num_kv_heads
    if schedule is None:
        query_lens = torch.diff(cu_query_lens).tolist()
        longest = (seq_lens.amax(1) if per_head else seq_lens).tolist()
        schedule = build_prefill_schedule(query_lens, config.tile_queries(group), q.device, longest)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out, the partial result to merge into")
    out, lse = out or _new_outputs(q)
    if schedule.shape[0] == 0:
        return out, lse
    tma = config.tma and _has_tma(q.device) and _describable(k_cache) and _describable(v_cache)
    k_arg, v_arg = (_cache_descriptor(c, config.block_n) for c in (k_cache, v_cache)) if tma else (k_cache, v_cache)
    pack = config.packs(group)
    _prefill_kernel[(num_kv_heads if pack else num_heads, schedule.shape[0])](
        q, k_arg, v_arg, out, lse, cu_query_lens, seq_lens, block_tables, schedule, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        *_cache_strides(k_cache, v_cache), block_tables.stride(0), block_tables.stride(1) if per_head else 0,
        num_kv_heads,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, PRECISION=_precision(q.dtype), CAUSAL=causal, ACCUMULATE=accumulate,
        PER_HEAD=per_head, TMA=tma, PACK=pack, TILE=config.tile_queries(group),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out, lse


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Tensor descriptors: this Triton has them, and Hopper or newer (the CPU interpreter emulates them)."""
    if TensorDescriptor is None:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _describable(cache: torch.Tensor) -> bool:
    """A cache [blocks, block_size, Hk, D] that a 2-D descriptor [blocks * block_size, Hk * D] covers,
    its rows addressed by int32 offsets."""
    return cache.is_contiguous() and cache.data_ptr() % 16 == 0 and cache.shape[0] * cache.shape[1] < 2**31


def _cache_descriptor(cache: torch.Tensor, block_n: int) -> TensorDescriptor:
    rows = cache.shape[0] * cache.shape[1]
    width = cache.shape[2] * cache.shape[3]
    return TensorDescriptor(cache, [rows, width], [width, 1], [block_n, cache.shape[3]])


__all__ = [
    "PrefillConfig", "build_prefill_schedule", "decode_num_splits", "decode_num_stages", "decode_tile_size",
    "kv_tile_size", "one_split_tile_size", "paged_decode_attention", "paged_prefill_attention", "prefill_config",
]
