"""Sweep the Quest block-score kernel's launch options on Llama-3.1-8B decode shapes (32 query heads,
8 KV heads, head_dim 128, 256-token blocks of 16-token pages, bf16 bounds); print the bounds' bytes
read per call over the kernel time as a fraction of the measured HBM copy bandwidth. Then the ordered
top kernel on page scores of the same shapes (budget 2048 tokens = 128 pages, sink and recent block's
pages) against top-k + sort (the reference), same results checked. With --candidates instead: the rerank's
candidate kernel (quest_rerank=2 at budget 2048: 256 candidate pages per KV head, their keys read from the
device pool) over its launch options, the candidates' key bytes over the kernel time as a fraction of HBM. With
--key-copy: the kernel scoring pages through quest_key_copy's copy (int8 codes, or with --key-copy-bits 4 two
4-bit codes per byte, and a float32 scale per key) over its launch options (tile, blocks per program, warps,
pipeline stages), the copy's bytes over the kernel time.

    PYTHONPATH=. python3 bench/tune_quest.py [--contexts 32768 131072] [--batches 1 4 16]
        [--top-only | --two-stage | --candidates | --key-copy [--key-copy-bits 8 4]]
        [--top-width 131072]  (--top-width: the score and top kernels also on tables that wide, as in a graph
        sized for that length)
"""
from __future__ import annotations

import argparse
import itertools

import torch

from common import graph_ms, log, measure_hbm_bandwidth, require_cuda, save_results
from nanovllm.kernels import triton_quest
from nanovllm.layers.quest import quest_top_reference

HEADS, KV_HEADS, DIM, BLOCK, PAGE = 32, 8, 128, 256, 16


def inputs(batch: int, context: int, width: int | None = None) -> tuple:
    """The scores kernel's call; with width (tokens), tables as wide as a graph sized for that length: the
    columns past the rows' ends hold block 0, as the engine's padded tables do."""
    blocks = -(-context // BLOCK)
    pages = batch * blocks * (BLOCK // PAGE)
    lo = torch.randn(pages, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    hi = lo + torch.rand_like(lo)
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
    if width is not None and -(-width // BLOCK) > blocks:
        tables = torch.nn.functional.pad(tables, (0, -(-width // BLOCK) - blocks))
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    empty = lo[:0]
    return (q, lo, hi, empty, empty, tables, seq_lens, BLOCK, PAGE, None), 2 * lo.numel() * lo.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--top-only", action="store_true", help="only the ordered top kernel")
    ap.add_argument("--two-stage", action="store_true",
                    help="only the two-stage top's segment sizes and warps (triton_quest.SEGMENT_*)")
    ap.add_argument("--candidates", action="store_true", help="only the rerank's candidate kernel")
    ap.add_argument("--key-copy", action="store_true", help="only the key copy's page-score kernel")
    ap.add_argument("--key-copy-bits", nargs="+", type=int, choices=[8, 4], default=[8],
                    help="with --key-copy: the copies swept (int8, int4)")
    ap.add_argument("--top-width", type=int, default=None,
                    help="the top kernel's rows as wide as this context's pages (a narrowed graph's width at this "
                         "max_model_len), the rows' own ends at --contexts; chunked peers besides the engine's "
                         "one-pass chunk")
    args = ap.parse_args()
    require_cuda()
    if args.key_copy:
        save_results("tune_quest_key_copy", sweep_key_copy(args))
        return
    if args.candidates:
        save_results("tune_quest_candidates", sweep_candidates(args))
        return
    if args.two_stage:
        save_results("tune_quest_two_stage", [sweep_two_stage(batch, context)
                                              for batch, context in itertools.product(args.batches, args.contexts)])
        return
    results = [time_top(batch, context, args.top_width)
               for batch, context in itertools.product(args.batches, args.contexts)]
    if not args.top_only:
        results += sweep_scores(args)
    save_results("tune_quest", results)


def time_top(batch: int, context: int, width_context: int | None = None, budget_tokens: int = 2048) -> dict:
    """Quest's page selection of one layer: the ordered top kernel as the engine calls it (rows up to
    width_context), in one stage at the engine's chunk and 4-32 warps, in two stages where rows are long enough,
    and, for rows narrower than the table, in chunks of 1,024 and 2,048 read up to each row's end; against
    top-k + sort. GPU times from CUDA graph replays (`graph_ms`), as the engine's decode graphs run them."""
    per_block, columns = BLOCK // PAGE, -(-context // BLOCK) * (BLOCK // PAGE)
    width = max(columns, -(-(width_context or context) // BLOCK) * per_block)
    scores = torch.randn(batch, KV_HEADS, width, device="cuda")
    scores[..., columns:] = float("-inf")
    ends = torch.full((batch,), columns, dtype=torch.int64, device="cuda")
    call = (scores, ends, per_block, budget_tokens // PAGE, per_block)
    want = quest_top_reference(*call)
    launches = {"engine": {}, "one_stage": dict(stages=1)}
    launches |= {f"one_stage_warps_{w}": dict(stages=1, num_warps=w) for w in (4, 8, 16, 32)}
    if triton_quest.top_segment(width, budget_tokens // PAGE):
        launches["two_stage"] = dict(stages=2)
    if width > columns:
        launches.update(chunked_1024=dict(stages=1, chunk=1024), chunked_2048=dict(stages=1, chunk=2048))
    ms = {}
    for name, options in launches.items():
        assert torch.equal(triton_quest.ordered_top_columns(*call, max_columns=width, **options), want)
        ms[name] = graph_ms(lambda: triton_quest.ordered_top_columns(*call, max_columns=width, **options))
    ms["topk_sort"] = graph_ms(lambda: quest_top_reference(*call))
    peers = ", ".join(f"{name} {t * 1e3:.1f} us ({ms['engine'] / t:.2f}x)" for name, t in ms.items()
                      if name != "engine")
    log(f"ordered top, {batch} x {context} ({columns} of {width} page columns, budget {budget_tokens // PAGE}): "
        f"as the engine calls it {ms['engine'] * 1e3:.1f} us; {peers} (x: its speed-up over the engine's call)")
    return dict(kernel="ordered_top", batch=batch, context=context, width=width, ms=ms)


def time_launches(fn, call: tuple, launches: list[dict], default: dict, nbytes: int, bandwidth: float, label: str,
                  **close) -> list[dict]:
    """fn(*call, **launch) for each launch option, checked against the default's result and timed from CUDA graph
    replays (`graph_ms`: GPU time, as inside the engine's decode graphs; CUDA events around back-to-back launches
    would count Triton's host launch for kernels this short): the rows by time (bytes over time as a fraction of
    HBM), the default and the best four logged."""
    want = fn(*call, **default)
    rows = []
    for launch in launches:
        torch.testing.assert_close(fn(*call, **launch), want, **close)
        ms = graph_ms(lambda: fn(*call, **launch))
        rows.append(dict(launch=launch, ms=ms, hbm_fraction=nbytes / (ms / 1e3) / bandwidth))
    rows.sort(key=lambda r: r["ms"])
    first = next(r for r in rows if r["launch"] == default)
    log(f"{label}: {nbytes / 1e6:.0f} MB; default {first['ms'] * 1e3:.0f} us ({first['hbm_fraction']:.2f} of HBM)")
    for r in rows[:4]:
        log(f"  {r['launch']}: {r['ms'] * 1e3:.0f} us, {r['hbm_fraction']:.2f} of HBM, "
            f"{first['ms'] / r['ms']:.2f}x the default")
    return rows


def sweep_two_stage(batch: int, context: int, budget_tokens: int = 2048) -> dict:
    """The two-stage top over the first stage's segment (SEGMENT_MIN, SEGMENT_BUDGETS) and warps (SEGMENT_WARPS, and
    the second stage's), each checked against top-k + sort; the one-stage kernel as the peer (graph replays)."""
    per_block, columns = BLOCK // PAGE, -(-context // BLOCK) * (BLOCK // PAGE)
    scores = torch.randn(batch, KV_HEADS, columns, device="cuda")
    ends = torch.full((batch,), columns, dtype=torch.int64, device="cuda")
    call = (scores, ends, per_block, budget_tokens // PAGE, per_block)
    want = quest_top_reference(*call)
    saved = {name: getattr(triton_quest, name) for name in ("SEGMENT_MIN", "SEGMENT_BUDGETS", "SEGMENT_WARPS")}
    one = graph_ms(lambda: triton_quest.ordered_top_columns(*call, stages=1))
    rows = []
    for least, budgets, warps, second in itertools.product([256, 512, 1024, 2048], [2, 4, 8], [2, 4, 8], [4, 8]):
        triton_quest.SEGMENT_MIN, triton_quest.SEGMENT_BUDGETS, triton_quest.SEGMENT_WARPS = least, budgets, warps
        segment = triton_quest.top_segment(columns, budget_tokens // PAGE)
        if segment is None or any(r["segment"] == segment and r["warps"] == (warps, second) for r in rows):
            continue
        assert torch.equal(triton_quest.ordered_top_columns(*call, stages=2, num_warps=second), want)
        ms = graph_ms(lambda: triton_quest.ordered_top_columns(*call, stages=2, num_warps=second))
        rows.append(dict(segment=segment, warps=(warps, second), ms=ms))
    for name, value in saved.items():
        setattr(triton_quest, name, value)
    rows.sort(key=lambda r: r["ms"])
    default = graph_ms(lambda: triton_quest.ordered_top_columns(*call))
    log(f"two-stage top, {batch} x {context} ({columns} page columns, budget {budget_tokens // PAGE}): one stage "
        f"{one * 1e3:.1f} us, the default call {default * 1e3:.1f} us; best: " + ", ".join(
            f"segment {r['segment']} warps {r['warps']} {r['ms'] * 1e3:.1f} us" for r in rows[:5]))
    return dict(batch=batch, context=context, one_stage_ms=one, default_ms=default, rows=rows)


def sweep_scores(args) -> list[dict]:
    bandwidth = measure_hbm_bandwidth()
    default = dict(blocks_per_program=triton_quest.BLOCKS_PER_PROGRAM, num_warps=triton_quest.NUM_WARPS,
                   use_dot=triton_quest.USE_DOT)
    launches = [dict(blocks_per_program=blocks, num_warps=warps, use_dot=dot)
                for blocks, warps, dot in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [True, False])]
    results = []
    for batch, context in itertools.product(args.batches, args.contexts):
        call, nbytes = inputs(batch, context)
        rows = time_launches(triton_quest.quest_block_scores, call, launches, default, nbytes, bandwidth,
                             f"batch {batch} x {context}: bounds", atol=1e-2, rtol=1e-3)
        results.append(dict(kernel="quest_scores", batch=batch, context=context, bytes=nbytes, rows=rows))
        if args.top_width and args.top_width > context:
            call, nbytes = inputs(batch, context, args.top_width)
            rows = time_launches(triton_quest.quest_block_scores, call, launches, default, nbytes, bandwidth,
                                 f"batch {batch} x {context} in tables {args.top_width} wide: bounds",
                                 atol=1e-2, rtol=1e-3)
            results.append(dict(kernel="quest_scores", batch=batch, context=context, width=args.top_width,
                                bytes=nbytes, rows=rows))
    return results


def candidate_inputs(batch: int, context: int, count: int) -> tuple:
    """A device pool holding batch sequences of context keys in shuffled blocks; per KV head `count` distinct
    page positions of its sequence, ascending (as narrow() passes them)."""
    blocks = -(-context // BLOCK)
    keys = torch.randn(batch * blocks, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    pages = -(-context // PAGE)
    candidates = torch.rand(batch, KV_HEADS, pages, device="cuda").argsort(-1)[..., :count].sort(-1).values
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    nbytes = batch * KV_HEADS * count * PAGE * DIM * keys.element_size()
    return (q, keys, None, tables, seq_lens, candidates.contiguous(), BLOCK, PAGE, None), nbytes


def sweep_candidates(args, budget_tokens: int = 2048, rerank: int = 2) -> list[dict]:
    bandwidth = measure_hbm_bandwidth()
    default = dict(candidates_per_program=8, num_warps=triton_quest.CANDIDATE_WARPS)
    launches = [dict(candidates_per_program=n, num_warps=w) for n, w in itertools.product([4, 8, 16], [4, 8])]
    results = []
    for batch, context in itertools.product(args.batches, args.contexts):
        call, nbytes = candidate_inputs(batch, context, rerank * budget_tokens // PAGE)
        rows = time_launches(triton_quest.candidate_max_scores, call, launches, default, nbytes, bandwidth,
                             f"candidates, batch {batch} x {context}: keys")
        results.append(dict(kernel="candidate_max", batch=batch, context=context, bytes=nbytes, rows=rows))
    return results


def key_copy_inputs(batch: int, context: int, bits: int = 8) -> tuple:
    """One layer's key copy (int8, or int4 two codes per byte) of batch sequences of context keys in shuffled
    device blocks."""
    blocks = -(-context // BLOCK)
    codes = torch.randint(-127, 128, (batch * blocks * BLOCK, KV_HEADS, DIM * bits // 8), dtype=torch.int8,
                          device="cuda")
    scales = torch.rand(batch * blocks * BLOCK, KV_HEADS, device="cuda") / 127
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    nbytes = batch * context * KV_HEADS * (DIM * bits // 8 + scales.element_size())
    return (q, codes, scales, codes[:0], scales[:0], tables, seq_lens, BLOCK, PAGE, None), nbytes


def sweep_key_copy(args) -> list[dict]:
    bandwidth = measure_hbm_bandwidth()
    results = []
    for bits in args.key_copy_bits:
        default = dict(pages=True, blocks_per_program=2, num_warps=triton_quest.KEY_COPY_WARPS,
                       tile=triton_quest.KEY_COPY_TILE, num_stages=triton_quest.KEY_COPY_STAGES, bits=bits)
        launches = [dict(pages=True, blocks_per_program=n, num_warps=w, tile=t, num_stages=st, bits=bits)
                    for n, w, t, st in itertools.product([1, 2, 4, 8], [4, 8], [64, 128], [1, 2, 3])]
        for batch, context in itertools.product(args.batches, args.contexts):
            call, nbytes = key_copy_inputs(batch, context, bits)
            rows = time_launches(triton_quest.key_copy_scores, call, launches, default, nbytes, bandwidth,
                                 f"int{bits} key copy, batch {batch} x {context}: pages", atol=1e-2, rtol=1e-3)
            results.append(dict(kernel="key_copy_scores", bits=bits, batch=batch, context=context, bytes=nbytes,
                                rows=rows))
    return results


if __name__ == "__main__":
    main()
