"""Quest's block scores in one Triton kernel, read straight from the key bounds through the block tables.

For a decode step's queries q [B, Hq, D] and per-page key bounds (min, max) [pages, Hk, D] of one layer
(device pages, plus host blocks' pages in a second array named by table entries >= base), the score of
sequence b's block c for KV head h is the largest, over the group's query heads and the block's pages
holding keys, of sum_d max(q_d * max_d, q_d * min_d) = q+ . max + q- . min; -inf past the sequence's
blocks. The same numbers as `QuestSelector.batch_block_scores`, the reference, but without gathering
the bounds of every page into a copy: grid (B, Hk, cdiv(W, BLOCKS)), each program reads its blocks'
pages once (16 x D per block of 256 tokens), so the scores cost one pass over the bounds and the
shapes alone fix the launch (no host value: it runs inside CUDA graphs). With `pages=True` the kernel
stores each page's bound instead of the block's maximum ([B, Hk, W * pages per block], for Quest's page
selection): the same reads, one store per page.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.sizes import cdiv, next_power_of_2
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

BLOCKS_PER_PROGRAM = 8  # bench/tune_quest.py, H200 (2026-12-04): 16x32K in 128K-wide tables 56 vs 67 us at 2,
# 4x32K 35 vs 45 us, elsewhere within 2%
NUM_WARPS = 1
USE_DOT = False  # bench/tune_quest.py: 5-12x faster than the tl.dot form on the H200
NO_SECOND_POOL = 1 << 62  # a base no table entry reaches


@triton.jit(do_not_specialize=["num_columns", "stride_tb"])  # table widths vary by step; offsets do not
def _quest_scores_kernel(
    q_ptr, lo_ptr, hi_ptr, tables_ptr, seq_lens_ptr, out_ptr, lo_delta, hi_delta, base, num_columns,
    stride_qb, stride_qh, stride_page, stride_ph, stride_tb, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGES: tl.constexpr,
    PAGES_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr,
    USE_DOT: tl.constexpr, PAGE_OUT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.program_id(2) * BLOCKS
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    written_pages = (seq_len + PAGE_SIZE - 1) // PAGE_SIZE
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    p = tl.arange(0, PAGES_PAD)
    q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)
    q_pos = tl.maximum(q, 0.0)
    q_neg = tl.minimum(q, 0.0)
    for i in range(BLOCKS):
        c = first + i
        in_table = c < num_columns
        if c < num_blocks:
            entry = tl.load(tables_ptr + b * stride_tb + c, mask=in_table, other=0)
            on_host = entry >= base
            block = tl.where(on_host, entry - base, entry)
            page_ok = (p < PAGES) & (c * PAGES + p < written_pages) & in_table
            offsets = (block * PAGES + p)[:, None] * stride_page + h * stride_ph + d[None, :]
            hi = tl.load(hi_ptr + offsets + tl.where(on_host, hi_delta, 0), mask=page_ok[:, None],
                         other=0.0).to(tl.float32)
            lo = tl.load(lo_ptr + offsets + tl.where(on_host, lo_delta, 0), mask=page_ok[:, None],
                         other=0.0).to(tl.float32)
            if USE_DOT:
                s = (tl.dot(q_pos, tl.trans(hi), input_precision="ieee")
                     + tl.dot(q_neg, tl.trans(lo), input_precision="ieee"))
            else:  # [group, pages, D] products summed over D: no padding of the group to 16 rows
                s = tl.sum(q_pos[:, None, :] * hi[None, :, :] + q_neg[:, None, :] * lo[None, :, :], axis=2)
            s = tl.where((g < GROUP)[:, None] & page_ok[None, :], s, float("-inf"))
            page_scores = tl.max(s, axis=0)  # [PAGES_PAD]
        else:  # past the row's end (graphs' tables are as wide as the longest sequence): no loads, no products
            page_scores = tl.full([PAGES_PAD], float("-inf"), tl.float32)
        if PAGE_OUT:
            tl.store(out_ptr + b * stride_ob + h * stride_oh + c * PAGES + p, page_scores, mask=(p < PAGES) & in_table)
        else:
            tl.store(out_ptr + b * stride_ob + h * stride_oh + c, tl.max(page_scores, axis=0), mask=in_table)


def quest_block_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, host_lo: torch.Tensor,
                       host_hi: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                       page_size: int, base: int | None, blocks_per_program: int = BLOCKS_PER_PROGRAM,
                       num_warps: int = NUM_WARPS, use_dot: bool = USE_DOT, pages: bool = False) -> torch.Tensor:
    """[B, Hk, W] float32 block scores ([B, Hk, W * block_size // page_size] page scores with pages). q [B, Hq, D]; lo/hi [pages, Hk, D] one layer's device page
    bounds, host_lo/host_hi the same for host blocks (entries >= base of tables [B, W]; may be empty);
    seq_lens [B]. The launch options are bench/tune_quest.py's sweep."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = lo.shape[1]
    if host_lo.numel() and (host_lo.stride() != lo.stride() or host_lo.dtype != lo.dtype or
                            host_hi.stride() != hi.stride() or host_hi.dtype != hi.dtype):
        raise ValueError("host page bounds need the device bounds' dtype and strides")
    lo_delta = (host_lo.data_ptr() - lo.data_ptr()) // lo.element_size() if host_lo.numel() else 0
    hi_delta = (host_hi.data_ptr() - hi.data_ptr()) // hi.element_size() if host_hi.numel() else 0
    width, per_block = tables.shape[1], block_size // page_size
    out = torch.empty(batch, num_kv_heads, width * (per_block if pages else 1), dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    group_pad = max(16, next_power_of_2(group)) if use_dot else next_power_of_2(group)
    pages_pad = max(16, next_power_of_2(per_block)) if use_dot else next_power_of_2(per_block)
    grid = (batch, num_kv_heads, cdiv(width, blocks_per_program))
    _quest_scores_kernel[grid](
        q, lo, hi, tables, seq_lens, out, lo_delta, hi_delta, NO_SECOND_POOL if base is None else base, width,
        q.stride(0), q.stride(1), lo.stride(0), lo.stride(1), tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, PAGES=per_block, PAGES_PAD=pages_pad, PAGE_SIZE=page_size,
        BLOCK_SIZE=block_size, BLOCKS=blocks_per_program, USE_DOT=use_dot, PAGE_OUT=pages, num_warps=num_warps,
    )
    return out


MAX_ROW_IN_REGISTERS = 16384  # columns a program holds at once; longer rows are read in chunks per pass
# a two-stage top's first stage: columns per program, at least SEGMENT_MIN and SEGMENT_BUDGETS budgets, and its
# warps; the second stage's warps. bench/tune_quest.py --two-stage on the H200 (2026-12-04, budget 128 pages): 1 / 4 /
# 8 x 128K 16.0-16.8 / 17.0 / 21.4 us, 1 x 1M 33.5 us (one stage 30.9 / 30.9 / 31.0 / 229.6 us)
SEGMENT_MIN = 2048
SEGMENT_BUDGETS = 8
SEGMENT_WARPS = 8
CANDIDATE_TOP_WARPS = 8
TWO_STAGE_MAX_ROWS = 64  # rows (sequences x KV heads) up to which a long row's top runs in two stages


@triton.jit
def _load_scores(scores_ptr, cols, lo, hi):
    return tl.load(scores_ptr + cols, mask=(cols >= lo) & (cols < hi), other=float("-inf"))


@triton.jit
def _order_keys_of(x):
    """uint32 keys ordered as the float32 scores x; 0 (below every score's key) for -inf: not a candidate."""
    bits = x.to(tl.int32, bitcast=True)
    as_unsigned = x.to(tl.uint32, bitcast=True)
    key = tl.where(bits >= 0, as_unsigned | 2147483648, as_unsigned ^ 4294967295)
    return tl.where(x == float("-inf"), 0, key)


@triton.jit
def _order_keys(scores_ptr, cols, lo, hi):
    """The order keys of the scores at cols; 0 outside [lo, hi)."""
    return _order_keys_of(_load_scores(scores_ptr, cols, lo, hi))


@triton.jit
def _digit_histogram(scores_ptr, keys, lo, hi, prefix, prefix_mask, shift, stop,
                     CHUNK: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """Counts of the 8-bit digit at `shift` over the row's candidates whose higher digits equal prefix's (read in
    chunks up to column stop, past the last candidate)."""
    if IN_REGISTERS:
        match = (keys > 0) & ((keys & prefix_mask) == prefix)
        return tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=match)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([256], dtype=tl.int32)
    for start in range(0, stop, CHUNK):
        chunk = _order_keys(scores_ptr, start + offs, lo, hi)
        match = (chunk > 0) & ((chunk & prefix_mask) == prefix)
        counts += tl.histogram(((chunk >> shift) & 255).to(tl.int32), 256, mask=match)
    return counts


@triton.jit
def _radix_threshold(row, keys, lo, hi, budget, stop, CHUNK: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """(t, need): the budget-th largest key t of the row's candidates, one 8-bit digit at a time from the top
    (radix select), and how many columns whose key equals t to keep. Too few candidates: t = 1, every one kept."""
    bins = tl.arange(0, 256)
    t = tl.full([], 0, tl.uint32)
    prefix_mask = tl.full([], 0, tl.uint32)
    need = budget
    counts = _digit_histogram(row, keys, lo, hi, t, prefix_mask, 24, stop, CHUNK, IN_REGISTERS)
    if tl.sum(counts, 0) > budget:
        for step in tl.static_range(4):
            shift = 24 - 8 * step
            if step > 0:
                counts = _digit_histogram(row, keys, lo, hi, t, prefix_mask, shift, stop, CHUNK, IN_REGISTERS)
            at_least = tl.cumsum(counts, 0, reverse=True)  # candidates with this digit or a higher one
            digit = tl.max(tl.where(at_least >= need, bins, -1), 0)
            need -= tl.sum(tl.where(bins > digit, counts, 0), 0)
            t += digit.to(tl.uint32) << shift
            prefix_mask += tl.full([], 255, tl.uint32) << shift
    else:
        t = tl.full([], 1, tl.uint32)
    return t, need


@triton.jit
def _kept(keys, t, need, equal_seen):
    """Which columns of a pass to keep (above t, or equal to it among the first `need` so far) and how many
    equal to t it held."""
    equal = keys == t
    take = (keys > t) | (equal & (equal_seen + tl.cumsum(equal.to(tl.int32), 0) <= need))
    return take, tl.sum(equal.to(tl.int32), 0)


@triton.jit(do_not_specialize=["num_columns", "budget", "stride_sb", "stride_sh", "stride_cb", "stride_ch"])
def _segment_top_kernel(
    scores_ptr, ends_ptr, cand_scores_ptr, cand_cols_ptr, num_columns, budget, stride_sb, stride_sh, stride_cb,
    stride_ch, SINK: tl.constexpr, RECENT: tl.constexpr, SEGMENT: tl.constexpr,
):
    """A two-stage top's first stage, one program per (sequence, KV head, segment of SEGMENT columns): the
    segment's top `budget` middle columns, scores and columns in column order (then -inf and -1), at
    [s * budget, (s + 1) * budget) of the row's candidates. A column of the row's top is in its segment's
    top, and the first of tied ones too, so the second stage over the candidates finds the row's top."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    end = tl.load(ends_ptr + b).to(tl.int32)
    row = scores_ptr + b.to(tl.int64) * stride_sb + h * stride_sh
    lo = SINK
    hi = tl.minimum(end - RECENT, num_columns)
    offs = tl.arange(0, SEGMENT)
    cols = s * SEGMENT + offs
    x = _load_scores(row, cols, lo, hi)
    keys = _order_keys_of(x)
    t, need = _radix_threshold(row, keys, lo, hi, budget, 0, SEGMENT, True)
    take, _ = _kept(keys, t, need, 0)
    slot = tl.cumsum(take.to(tl.int32), 0) - 1
    written = tl.sum(take.to(tl.int32), 0)
    out = b.to(tl.int64) * stride_cb + h * stride_ch + s * budget
    tl.store(cand_scores_ptr + out + slot, x, mask=take)
    tl.store(cand_cols_ptr + out + slot, cols.to(tl.int64), mask=take)
    pad = (offs >= written) & (offs < budget)
    tl.store(cand_scores_ptr + out + offs, tl.full([SEGMENT], float("-inf"), tl.float32), mask=pad)
    tl.store(cand_cols_ptr + out + offs, tl.full([SEGMENT], -1, tl.int64), mask=pad)


@triton.jit(do_not_specialize=["num_columns", "budget", "stride_sb", "stride_sh", "stride_ob", "stride_oh"])
def _ordered_top_kernel(
    scores_ptr, cols_ptr, ends_ptr, out_ptr, num_columns, budget, stride_sb, stride_sh, stride_ob, stride_oh,
    SINK: tl.constexpr, RECENT: tl.constexpr, FIXED_PAD: tl.constexpr, CHUNK: tl.constexpr,
    IN_REGISTERS: tl.constexpr, CANDIDATES: tl.constexpr,
):
    """One (sequence, KV head) row: the sink's columns, the budget's top columns of the middle in column
    order, the recent columns; -1 for none. IN_REGISTERS: CHUNK covers the row, read once; else the row is read
    in chunks up to its last candidate (a row shorter than the table's width costs its own length).
    CANDIDATES: a two-stage top's second stage, the row is the first stage's candidates (every entry a middle
    one, its column at cols_ptr, same strides)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    end = tl.load(ends_ptr + b).to(tl.int32)
    row = scores_ptr + b.to(tl.int64) * stride_sb + h * stride_sh
    out = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    if CANDIDATES:
        lo = 0
        hi = num_columns
    else:
        lo = SINK
        hi = end - RECENT
    offs = tl.arange(0, CHUNK)
    stop = tl.minimum(hi, num_columns)  # columns past the last candidate hold none
    keys = _order_keys(row, offs, lo, hi)  # the row when IN_REGISTERS, else its first chunk (unused)
    t, need = _radix_threshold(row, keys, lo, hi, budget, stop, CHUNK, IN_REGISTERS)
    written = 0
    equal_seen = 0
    for start in range(0, stop, CHUNK):  # ordered compaction of the kept columns
        cols = start + offs
        if not IN_REGISTERS:
            keys = _order_keys(row, cols, lo, hi)
        take, equal = _kept(keys, t, need, equal_seen)
        slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
        if CANDIDATES:
            kept = tl.load(cols_ptr + b.to(tl.int64) * stride_sb + h * stride_sh + cols, mask=take, other=-1)
        else:
            kept = cols.to(tl.int64)
        tl.store(out + SINK + slot, kept, mask=take)
        written += tl.sum(take.to(tl.int32), 0)
        equal_seen += equal
    for start in range(0, budget, CHUNK):
        slot = start + offs
        tl.store(out + SINK + slot, tl.full([CHUNK], -1, tl.int64), mask=(slot >= written) & (slot < budget))
    i = tl.arange(0, FIXED_PAD)
    tl.store(out + i, tl.where(i < end, i, -1).to(tl.int64), mask=i < SINK)
    recent = end - RECENT + i
    tl.store(out + SINK + budget + i, tl.where(recent >= SINK, recent, -1).to(tl.int64), mask=i < RECENT)


def ordered_top_chunk(max_columns: int) -> int:
    """Columns per pass of ordered_top_columns for rows of up to max_columns columns: the whole row up to
    MAX_ROW_IN_REGISTERS. A caller that passes this for every row compiles one variant (two past the cap)."""
    return min(next_power_of_2(max(max_columns, 256)), MAX_ROW_IN_REGISTERS)


def top_segment(num_columns: int, budget: int) -> int | None:
    """Columns per first-stage program of a two-stage top over rows num_columns wide (SEGMENT_MIN, at least
    SEGMENT_BUDGETS budgets; at least 4 segments a row); None: too short a row for two stages."""
    segment = max(SEGMENT_MIN, next_power_of_2(SEGMENT_BUDGETS * max(budget, 1)))
    return segment if budget > 0 and num_columns >= 4 * segment and segment <= MAX_ROW_IN_REGISTERS else None


def ordered_top_columns(scores: torch.Tensor, ends: torch.Tensor, sink: int, budget: int, recent: int,
                        chunk: int | None = None, num_warps: int | None = None, stages: int | None = None,
                        max_columns: int | None = None) -> torch.Tensor:
    """Quest's kept columns as positions [B, Hk, sink + budget + recent] (int64, -1 for none) from page or
    block scores [B, Hk, C] float32 (-inf: no keys) and each row's column count ends [B]: the sink's
    columns, the top `budget` columns of the middle [sink, end - recent) in column order, the recent
    columns. One program per row finds the budget-th largest score by a radix select on an order key of
    its bits (four 256-bin histograms of the row, held in registers up to MAX_ROW_IN_REGISTERS columns),
    then compacts the columns at or above it in order: no top-k, no sort. `quest_top_reference` defines the
    result (ties at the threshold: the first columns). chunk: columns per pass (default: the row's
    `ordered_top_chunk`, a variant per power of two; a fixed one serves every narrower row). num_warps: default
    a warp per 512 columns of a chunk, 4 to 16 (`bench/tune_quest.py --top-only` sweeps it).
    stages: 2 splits long rows in segments first (`top_segment`), each segment's top by its own program, then
    the row's top among those candidates: a few rows (batch 1) keep more SMs busy; default 2 where
    `top_segment` allows and the rows are at most TWO_STAGE_MAX_ROWS, else 1. max_columns: the widest row the
    caller passes (default this call's): the default chunks follow from it, one variant for narrower rows too."""
    batch, heads, num_columns = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError("scores must be float32 with contiguous rows")
    segment = top_segment(num_columns, budget)
    if stages is None:
        stages = 2 if segment and batch * heads <= TWO_STAGE_MAX_ROWS else 1
    if stages == 2 and segment is None:
        raise ValueError(f"a two-stage top needs rows of at least {4 * SEGMENT_MIN} columns and {SEGMENT_BUDGETS} "
                         f"budgets' worth a segment; got {num_columns} columns, budget {budget}")
    if stages == 2:
        segments = cdiv(num_columns, segment)
        cand_scores = torch.empty(batch, heads, segments * budget, dtype=torch.float32, device=scores.device)
        cand_cols = torch.empty(batch, heads, segments * budget, dtype=torch.int64, device=scores.device)
        _segment_top_kernel[(batch, heads, segments)](
            scores, ends, cand_scores, cand_cols, num_columns, budget, scores.stride(0), scores.stride(1),
            cand_scores.stride(0), cand_scores.stride(1), SINK=sink, RECENT=recent, SEGMENT=segment,
            num_warps=SEGMENT_WARPS,
        )
        widest = cdiv(max(max_columns or 0, num_columns), segment) * budget
        return _ordered_top(cand_scores, cand_cols, ends, sink, budget, recent, ordered_top_chunk(widest),
                            num_warps or CANDIDATE_TOP_WARPS)
    chunk = chunk or ordered_top_chunk(max(max_columns or 0, num_columns))
    return _ordered_top(scores, None, ends, sink, budget, recent, chunk, num_warps)


def _ordered_top(scores: torch.Tensor, cols: torch.Tensor | None, ends: torch.Tensor, sink: int, budget: int,
                 recent: int, chunk: int, num_warps: int | None) -> torch.Tensor:
    batch, heads, num_columns = scores.shape
    out = torch.empty(batch, heads, sink + budget + recent, dtype=torch.int64, device=scores.device)
    _ordered_top_kernel[(batch, heads)](
        scores, scores if cols is None else cols, ends, out, num_columns, budget, scores.stride(0), scores.stride(1),
        out.stride(0), out.stride(1), SINK=sink, RECENT=recent, FIXED_PAD=next_power_of_2(max(sink, recent, 1)),
        CHUNK=chunk, IN_REGISTERS=chunk >= num_columns, CANDIDATES=cols is not None,
        num_warps=num_warps or max(4, min(16, chunk // 512)),
    )
    return out


CANDIDATE_WARPS = 8  # the candidate kernel's 128 x head_dim key tile without register spills (ptxas, sm_90)


# candidate counts (and the output's strides with them) and table widths vary by step
@triton.jit(do_not_specialize=["num_candidates", "stride_tb", "stride_ob", "stride_oh", "stride_og"])
def _candidate_max_kernel(
    q_ptr, k_ptr, tables_ptr, seq_lens_ptr, cand_ptr, out_ptr, reads_ptr, host_delta, base, num_candidates, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_cb, stride_ch, stride_ob, stride_oh,
    stride_og, stride_r,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, COLUMN: tl.constexpr,
    PER_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, CANDIDATES: tl.constexpr, TOKENS: tl.constexpr,
    COUNT_HOST: tl.constexpr, HEAD_LSE: tl.constexpr,
):
    """One (sequence, KV head, run of CANDIDATES candidates): each candidate column's largest q . k over its keys
    before the sequence's end and the KV head's query heads, -inf for none (HEAD_LSE: each query head's
    log-sum-exp of q . k * qk_scale over those keys instead, at out_ptr + head * stride_og); keys of host blocks
    (table entries >= base) read host_delta elements away, from pinned memory in place (COUNT_HOST: their
    candidates added to reads_ptr[sequence]). The run's keys come as one tile of CANDIDATES x TOKENS rows per
    TOKENS of a column (every candidate's table entry and keys loaded at once, not one candidate after another)
    and meet the query heads in one matrix product (GROUP_PAD >= 16 rows, the padding zero)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, CANDIDATES)
    q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)
    first = tl.program_id(2) * CANDIDATES
    cand_row = cand_ptr + b * stride_cb + h * stride_ch + first
    n = first + c
    col = tl.load(cand_row + c, mask=n < num_candidates, other=-1)
    entry = tl.load(tables_ptr + b * stride_tb + tl.maximum(col, 0) // PER_BLOCK, mask=col >= 0, other=0)
    host_reads = tl.sum(((col >= 0) & (entry >= base)).to(tl.int32), 0)
    # the same per key row of the tile (row r: candidate r // TOKENS), loaded again (cached) rather than gathered
    r = tl.arange(0, CANDIDATES * TOKENS)
    row_col = tl.load(cand_row + r // TOKENS, mask=first + r // TOKENS < num_candidates, other=-1)
    row_valid = row_col >= 0
    row_col = tl.maximum(row_col, 0)
    row_block_col = row_col // PER_BLOCK
    row_entry = tl.load(tables_ptr + b * stride_tb + row_block_col, mask=row_valid, other=0)
    row_on_host = row_entry >= base
    row_base = tl.where(row_on_host, row_entry - base, row_entry) * stride_kb + tl.where(row_on_host, host_delta, 0)
    best = tl.full([CANDIDATES], float("-inf"), tl.float32)
    head_max = tl.full([GROUP_PAD, CANDIDATES], float("-inf"), tl.float32)  # HEAD_LSE: running max and sum
    head_sum = tl.zeros([GROUP_PAD, CANDIDATES], tl.float32)
    for start in tl.static_range(0, COLUMN, TOKENS):
        token = (row_col % PER_BLOCK) * COLUMN + start + r % TOKENS
        ok = row_valid & (row_block_col * BLOCK_SIZE + token < seq_len)
        k = tl.load(k_ptr + row_base[:, None] + token[:, None] * stride_kt + h * stride_kh + d[None, :],
                    mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [GROUP_PAD, CANDIDATES * TOKENS]
        s = tl.where((g < GROUP)[:, None] & ok[None, :], s, float("-inf"))
        s = tl.reshape(s, [GROUP_PAD, CANDIDATES, TOKENS])
        if HEAD_LSE:
            s = s * qk_scale
            new_max = tl.maximum(head_max, tl.max(s, axis=2))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: nothing to rescale
            head_sum = head_sum * tl.exp(head_max - shift) + tl.sum(tl.exp(s - shift[:, :, None]), axis=2)
            head_max = new_max
        else:
            best = tl.maximum(best, tl.max(tl.max(s, axis=2), axis=0))
    out = out_ptr + b * stride_ob + h * stride_oh
    if HEAD_LSE:
        lse = head_max + tl.log(tl.where(head_sum > 0, head_sum, 1.0))  # -inf where no key
        in_range = (g < GROUP)[:, None] & (n < num_candidates)[None, :]
        tl.store(out + g[:, None] * stride_og + n[None, :], lse, mask=in_range)
    else:
        tl.store(out + n, best, mask=n < num_candidates)
    if COUNT_HOST:
        tl.atomic_add(reads_ptr + b * stride_r, host_reads.to(tl.int64))


def candidate_max_scores(q: torch.Tensor, keys: torch.Tensor, host_keys: torch.Tensor | None, tables: torch.Tensor,
                         seq_lens: torch.Tensor, candidates: torch.Tensor, block_size: int, column_size: int,
                         base: int | None, candidates_per_program: int = 8,
                         key_reads: torch.Tensor | None = None, head_lse: bool = False,
                         num_warps: int = CANDIDATE_WARPS) -> torch.Tensor:
    """[B, Hk, N] float32: `QuestSelector.candidate_scores` (its reference) in one launch. q [B, Hq, D]; keys [blocks,
    block_size, Hk, D] one layer's device pool, host_keys the host pool's (pinned, read in place; table entries
    >= base of tables [B, W]); candidates [B, Hk, N] column positions of column_size tokens (-1: none);
    key_reads [B] int64 (any stride), if given: each sequence's candidates read from the host pool added to it.
    head_lse: [B, Hk, group, N], each query head's log-sum-exp of q . k / sqrt(D) over a candidate's keys."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, count = candidates.shape[1], candidates.shape[2]
    if host_keys is not None and (host_keys.stride() != keys.stride() or host_keys.dtype != keys.dtype):
        raise ValueError("host keys need the device pool's dtype and strides")
    if candidates.stride(-1) != 1:
        raise ValueError("candidates must have contiguous rows")
    if candidates_per_program & (candidates_per_program - 1):
        raise ValueError(f"candidates_per_program must be a power of two, got {candidates_per_program}")
    host_delta = (host_keys.data_ptr() - keys.data_ptr()) // keys.element_size() if host_keys is not None else 0
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_kv_heads, *([group] if head_lse else []), count, dtype=torch.float32,
                      device=q.device)
    grid = (batch, num_kv_heads, cdiv(max(count, 1), candidates_per_program))
    _candidate_max_kernel[grid](
        q, keys, tables, seq_lens, candidates, out, key_reads if key_reads is not None else out, host_delta,
        NO_SECOND_POOL if base is None else base, count, head_dim**-0.5,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), tables.stride(0),
        candidates.stride(0), candidates.stride(1), out.stride(0), out.stride(1), out.stride(2) if head_lse else 0,
        key_reads.stride(0) if key_reads is not None else 0,
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, COLUMN=column_size,
        PER_BLOCK=block_size // column_size, BLOCK_SIZE=block_size, CANDIDATES=candidates_per_program,
        TOKENS=min(column_size, 16), COUNT_HOST=key_reads is not None and host_keys is not None, HEAD_LSE=head_lse,
        num_warps=num_warps,
    )
    return out


KEY_COPY_TILE = 128  # tokens of a block whose codes meet the query heads in one matrix product (tuned, sm_90)
KEY_COPY_WARPS = 4
KEY_COPY_STAGES = 2


@triton.jit
def _codes_dot(q, codes, IEEE: tl.constexpr, USE_DOT: tl.constexpr):
    """[GROUP_PAD, TILE] float32 q . codes: a tensor-core product (codes exact in bf16 / fp16; IEEE: in fp32),
    or for codes narrower than a product's 16 (a 4-bit copy of head_dim < 32) broadcast products summed."""
    if not USE_DOT:
        s = tl.sum(q.to(tl.float32)[:, None, :] * codes.to(tl.float32)[None, :, :], axis=2)
    elif IEEE:
        s = tl.dot(q, tl.trans(codes.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(codes.to(q.dtype)))
    return s


@triton.jit(do_not_specialize=["num_columns", "stride_tb"])
def _key_copy_scores_kernel(
    q_ptr, codes_ptr, scales_ptr, tables_ptr, seq_lens_ptr, out_ptr, codes_delta, scales_delta, base, num_columns,
    stride_qb, stride_qh, stride_cr, stride_ch, stride_sr, stride_sh, stride_tb, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCKS: tl.constexpr, PAGE_OUT: tl.constexpr,
    IEEE: tl.constexpr, STAGES: tl.constexpr, BITS: tl.constexpr,
):
    """One (sequence, KV head, run of BLOCKS blocks): per page (PAGE_OUT) or block, the largest
    scale_t * (q . codes_t) over its tokens before the sequence's end and the group's query heads; host
    blocks (table entries >= base) read codes_delta / scales_delta elements away. BITS 4: a byte holds the
    codes of dimensions 2i (low nibble) and 2i + 1 (high), met by the queries' even and odd dimensions. The
    run's tiles are one loop (its loads pipelined over STAGES); a run past the sequence's end loads nothing."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.program_id(2) * BLOCKS
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    WIDTH: tl.constexpr = HEAD_DIM * BITS // 8  # bytes of a token's codes
    d = tl.arange(0, WIDTH)
    t = tl.arange(0, TILE)
    out_row = out_ptr + b * stride_ob + h * stride_oh
    TILES: tl.constexpr = BLOCK_SIZE // TILE
    if first * BLOCK_SIZE < seq_len:
        q_rows = q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh
        q = tl.load(q_rows + (d if BITS == 8 else 2 * d)[None, :], mask=(g < GROUP)[:, None], other=0.0)
        if BITS == 4:
            q_odd = tl.load(q_rows + (2 * d + 1)[None, :], mask=(g < GROUP)[:, None], other=0.0)
        else:
            q_odd = q
        if IEEE:
            q, q_odd = q.to(tl.float32), q_odd.to(tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        for j in tl.range(0, BLOCKS * TILES, num_stages=STAGES):
            c = first + j // TILES
            start = (j % TILES) * TILE
            in_table = c < num_columns
            entry = tl.load(tables_ptr + b * stride_tb + c, mask=in_table, other=0)
            on_host = entry >= base
            block = tl.where(on_host, entry - base, entry).to(tl.int64)
            token = start + t
            ok = (c * BLOCK_SIZE + token < seq_len) & in_table
            rows = block * BLOCK_SIZE + token
            codes = tl.load(codes_ptr + rows[:, None] * stride_cr + h * stride_ch + d[None, :]
                            + tl.where(on_host, codes_delta, 0), mask=ok[:, None], other=0)
            scale = tl.load(scales_ptr + rows * stride_sr + h * stride_sh + tl.where(on_host, scales_delta, 0),
                            mask=ok, other=0.0)
            if BITS == 4:  # arithmetic shifts give each nibble its sign
                s = _codes_dot(q, (codes << 4) >> 4, IEEE, WIDTH >= 16) + _codes_dot(q_odd, codes >> 4, IEEE,
                                                                                     WIDTH >= 16)
            else:
                s = _codes_dot(q, codes, IEEE, WIDTH >= 16)
            s = tl.where((g < GROUP)[:, None] & ok[None, :], s * scale[None, :], float("-inf"))
            token_best = tl.max(s, axis=0)  # [TILE]
            if PAGE_OUT:
                page_best = tl.max(tl.reshape(token_best, [TILE // PAGE_SIZE, PAGE_SIZE]), axis=1)
                p = (c * BLOCK_SIZE + start) // PAGE_SIZE + tl.arange(0, TILE // PAGE_SIZE)
                tl.store(out_row + p, page_best, mask=in_table)
            else:  # the block's best, stored with its last tile
                best = tl.maximum(best, tl.max(token_best, axis=0))
                last = start + TILE == BLOCK_SIZE
                tl.store(out_row + c, best, mask=in_table & last)
                best = tl.where(last, float("-inf"), best)
    else:
        for j in range(0, BLOCKS * TILES):
            c = first + j // TILES
            if PAGE_OUT:
                p = (c * BLOCK_SIZE + (j % TILES) * TILE) // PAGE_SIZE + tl.arange(0, TILE // PAGE_SIZE)
                tl.store(out_row + p, tl.full([TILE // PAGE_SIZE], float("-inf"), tl.float32), mask=c < num_columns)
            else:
                tl.store(out_row + c, float("-inf"), mask=c < num_columns)

def key_copy_scores(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, host_codes: torch.Tensor,
                    host_scales: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    page_size: int, base: int | None, pages: bool = False, blocks_per_program: int = 2,
                    num_warps: int = KEY_COPY_WARPS, tile: int = KEY_COPY_TILE,
                    num_stages: int = KEY_COPY_STAGES, bits: int = 8) -> torch.Tensor:
    """[B, Hk, W] float32 (pages: [B, Hk, W * block_size // page_size]): `QuestSelector.copy_scores` (its
    reference) in one launch. q [B, Hq, D]; codes [rows, Hk, D] int8 and scales [rows, Hk] one layer's key
    copy of the device pool (row = block * block_size + token; bits 4: codes [rows, Hk, D / 2], two per byte,
    `BlockKeyCopy`'s packing), host_codes / host_scales the host blocks'
    (entries >= base of tables [B, W]; may be empty); seq_lens [B]. tile: tokens per matrix product (at most
    the block; a power of two dividing it is used); `bench/tune_quest.py --key-copy` sweeps the launch."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = codes.shape[1]
    if codes.shape[2] != head_dim * bits // 8:
        raise ValueError(f"codes of {codes.shape[2]} bytes per key at {bits} bits for head_dim {head_dim}")
    if host_codes.numel() and (host_codes.stride() != codes.stride() or host_scales.stride() != scales.stride()):
        raise ValueError("the host blocks' key copy needs the device copy's strides")
    codes_delta = host_codes.data_ptr() - codes.data_ptr() if host_codes.numel() else 0
    scales_delta = (host_scales.data_ptr() - scales.data_ptr()) // scales.element_size() if host_scales.numel() else 0
    width, tile = tables.shape[1], math.gcd(tile, block_size)  # a power of two dividing the block
    out = torch.empty(batch, num_kv_heads, width * (block_size // page_size if pages else 1), dtype=torch.float32,
                      device=q.device)
    group = num_heads // num_kv_heads
    grid = (batch, num_kv_heads, cdiv(width, blocks_per_program))
    _key_copy_scores_kernel[grid](
        q, codes, scales, tables, seq_lens, out, codes_delta, scales_delta, NO_SECOND_POOL if base is None else base,
        width, q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
        tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_SIZE=block_size, TILE=tile, BLOCKS=blocks_per_program, PAGE_OUT=pages,
        IEEE=q.dtype == torch.float32, STAGES=num_stages, BITS=bits, num_warps=num_warps,
    )
    return out
