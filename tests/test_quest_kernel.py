"""Quest's block-score kernel (kernels/triton_quest.py) against QuestSelector.batch_block_scores, the
PyTorch reference, on random bounds of device and host blocks (Triton's CPU interpreter without CUDA)."""
from __future__ import annotations

import pytest
import torch

from compiled_helpers import assert_runs_compiled
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.layers.block_metadata import BlockKeyBounds
from nanovllm.layers.block_selector import DecodeLayout, SelectionInput
from nanovllm.layers.quest import QuestSelector

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BASE = 1 << 40


@pytest.mark.parametrize("block_size, num_kv_heads, group, host", [(16, 2, 3, False), (32, 2, 2, True),
                                                                    (64, 1, 4, True), (32, 4, 1, False)])
@pytest.mark.parametrize("launch", [dict(), dict(blocks_per_program=1, num_warps=2, use_dot=False),
                                    dict(blocks_per_program=4, use_dot=True, num_warps=4), dict(blocks_per_program=8, use_dot=True, num_warps=4)],
                         ids=["default", "1-block-sum", "4-block-dot", "8-block-dot"])
@pytest.mark.parametrize("pages", [False, True], ids=["blocks", "pages"])
def test_kernel_scores_equal_the_reference(block_size, num_kv_heads, group, host, launch, pages):
    """Block scores, or with pages=True each page's (Quest's page selection)."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_quest import quest_block_scores

    g = torch.Generator().manual_seed(block_size + num_kv_heads)
    dim, num_blocks, num_host = 16, 24, 12
    cache = PagedKVCache(1, num_blocks, block_size, num_kv_heads, dim, torch.float32, torch.device("cpu"))
    bounds = BlockKeyBounds(1, num_blocks, num_host, block_size, num_kv_heads, dim, torch.device("cpu"), page_size=16)
    cache.hooks.append(bounds)
    seq_lens = [5 * block_size + 7, 2 * block_size, 9 * block_size + 1]  # a partial last block, a full one
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    for table, n in zip(tables, seq_lens):
        keys = torch.randn(n, num_kv_heads, dim, generator=g)
        cache.write(0, keys, keys, torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)]))
    on_host = [[host and c % 2 == 0 and c < len(t) - 1 for c in range(len(t))] for t in tables]
    moves, located, next_host = [], [], 0
    for table, flags in zip(tables, on_host):
        row = []
        for b, h in zip(table, flags):
            if h:
                moves.append((b, next_host))
                row.append(next_host)
                next_host += 1
            else:
                row.append(b)
        located.append(row)
    if moves:
        cache.moved_to_host(moves)
    batch = SelectionInput([1] * 3, seq_lens, block_size, located, on_host if host else None)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=BASE if host else None)
    q = torch.randn(3, num_kv_heads * group, dim, generator=g)
    want = QuestSelector(bounds, 4 * block_size, 0, 0).batch_block_scores(0, q, num_kv_heads, layout, pages=pages)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = quest_block_scores(to(q), to(bounds.min[0]), to(bounds.max[0]), to(bounds.host_min[0]),
                             to(bounds.host_max[0]), to(layout.ids), to(layout.seq_lens), block_size, 16,
                             layout.base, pages=pages, **launch).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-5)
    columns = (lambda n: -(-n // 16)) if pages else (lambda n: -(-n // block_size))  # pages or blocks holding keys
    assert finite.sum() == sum(columns(n) for n in seq_lens) * num_kv_heads


def test_request_dependent_scalars_compile_no_new_kernel_variant():
    """Triton specialises integer arguments on == 1 and divisibility by 16; arguments whose values change
    from step to step (table widths, split counts, a chunk's rows: the merge's last chunk of a 131,071-token
    prompt compiled on the request path on an H100) must opt out, or a new value compiles a variant on the
    request path. Checked on the compiled (not interpreted) kernels."""
    code = """
from nanovllm.kernels import triton_merge as m, triton_paged_attention as t, triton_quest as q, triton_xattention as x
wanted = {m._merge_two_kernel: {"num_rows"},
          t._decode_kernel: {"num_splits", "stride_bt", "stride_bh"},
          t._prefill_kernel: {"stride_bt", "stride_bh"},
          q._quest_scores_kernel: {"num_columns", "stride_tb"},
          q._candidate_max_kernel: {"num_candidates", "stride_tb", "stride_ob", "stride_oh", "stride_og"},
          x._estimate_kernel: {"seq_len", "first_row_tile", "num_blocks", "num_splits", "group", "q_row_stride",
                               "k_row_stride", "stride_ph", "stride_pr", "stride_mh", "stride_mr", "stride_sh",
                               "stride_sr"},
          x._estimate_epilogue_kernel: {"seq_len", "start", "first_row_tile", "row_tiles", "num_granules",
                                        "num_blocks", "stride_oh", "stride_or", "stride_ph", "stride_pr",
                                        "stride_mh", "stride_mr", "stride_sh", "stride_sr"}}
for kernel, names in wanted.items():
    loose = {p.name for p in kernel.params if p.do_not_specialize}
    assert names <= loose, (kernel.fn.__name__, names - loose)
print("ok")
"""
    pytest.importorskip("triton")
    assert_runs_compiled(code, timeout=120)


def test_ordered_top_kernel_compiles_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects (a plain global in a jit function, once): the top
    kernel's variants (page rows, block rows, rows read in chunks, a two-stage top's candidates) and the first
    stage's segment kernel compiled for sm_90 through Triton's own ptxas, no GPU needed."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_quest import _ordered_top_kernel as kernel, _segment_top_kernel as segment
target = GPUTarget("cuda", 90, 32)
sig = {name: "i32" for name in kernel.arg_names[4:10]}
sig.update(scores_ptr="*fp32", ends_ptr="*i64", out_ptr="*i64")
sig.update({name: "constexpr" for name in kernel.arg_names[10:]})
for chunk, in_registers, candidates in [(8192, True, False), (512, True, False), (16384, False, False),
                                        (1024, True, True)]:
    consts = dict(SINK=16, RECENT=16, FIXED_PAD=16, CHUNK=chunk, IN_REGISTERS=in_registers, CANDIDATES=candidates)
    compiled = triton.compile(ASTSource(kernel, dict(sig, cols_ptr="*i64" if candidates else "*fp32"), consts),
                              target=target, options={"num_warps": 16})
    assert compiled.asm["cubin"]
sig = {name: "i32" for name in segment.arg_names[4:10]}
sig.update(scores_ptr="*fp32", ends_ptr="*i64", cand_scores_ptr="*fp32", cand_cols_ptr="*i64")
sig.update({name: "constexpr" for name in segment.arg_names[10:]})
compiled = triton.compile(ASTSource(segment, sig, dict(SINK=16, RECENT=16, SEGMENT=1024)), target=target,
                          options={"num_warps": 4})
assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)


def test_candidate_max_kernel_compiles_for_sm90_without_a_gpu():
    """quest_rerank's kernel compiled for sm_90 through Triton's ptxas: Llama-3.1-8B's shape with pages and with
    whole blocks as columns, SmolLM2's (3 query heads per KV head, head_dim 64), and Qwen2.5-0.5B's (7, 64) with
    each query head's log-sum-exp (quest_rerank_score "mass")."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_quest import _candidate_max_kernel as kernel
names = kernel.arg_names
first_constexpr = names.index("GROUP")
sig = {name: "i32" for name in names[6:first_constexpr]}
sig.update(q_ptr="*bf16", k_ptr="*bf16", tables_ptr="*i64", seq_lens_ptr="*i64", cand_ptr="*i64", out_ptr="*fp32",
           reads_ptr="*i64", host_delta="i64", base="i64", qk_scale="fp32")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
for group, dim, column, count, lse in [(4, 128, 16, True, False), (4, 128, 256, False, False), (3, 64, 16, True, False),
                                       (7, 64, 16, True, True)]:
    consts = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, COLUMN=column,
                  PER_BLOCK=256 // column, BLOCK_SIZE=256, CANDIDATES=8, TOKENS=16, COUNT_HOST=count, HEAD_LSE=lse)
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)


@pytest.mark.parametrize("chunk", [None, 64, 1024], ids=["row-in-registers", "chunked", "wider-than-the-row"])
@pytest.mark.parametrize("sink, budget, recent", [(16, 64, 16), (4, 10, 4), (16, 100, 16), (1, 0, 1)])
def test_ordered_top_columns_equal_the_reference(chunk, sink, budget, recent):
    """Quest's kept positions from one Triton kernel (radix select on the scores' order keys, ordered
    compaction) equal top-k + sort: negative and positive scores, rows ending early (-inf past their
    keys), rows with fewer candidates than the budget, a row shorter than its sink and recent columns."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_quest import ordered_top_columns
    from nanovllm.layers.quest import quest_top_reference

    g = torch.Generator().manual_seed(budget + sink)
    scores = torch.randn(5, 2, 300, generator=g)
    ends = torch.tensor([300, 120, 40, 20, 3])
    for b, end in enumerate(ends.tolist()):
        scores[b, :, end:] = float("-inf")
    want = quest_top_reference(scores, ends, sink, budget, recent)
    got = ordered_top_columns(scores.to(DEVICE), ends.to(DEVICE), sink, budget, recent, chunk=chunk)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("step", [0.0, 2.0**-22, 2.0**-14], ids=["all-equal", "last-bits", "low-bytes"])
def test_ordered_top_columns_over_narrow_score_ranges(step):
    """Distinct scores that share their high bytes (the radix select's first digits are all alike) give
    top-k + sort's columns, and all-equal scores the first middle columns (the kernel's rule for ties) but
    for a high run of 16 in one row."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_quest import ordered_top_columns
    from nanovllm.layers.quest import quest_top_reference

    g = torch.Generator().manual_seed(7)
    scores = 1.5 + step * torch.stack([torch.randperm(512, generator=g) for _ in range(6)]).view(2, 3, 512).float()
    scores[1, :, 64:80] += 1.0  # one high group of 16 in the second row
    ends = torch.tensor([512, 500])
    scores[1, :, 500:] = float("-inf")
    sink, budget, recent = 16, 40, 16
    got = ordered_top_columns(scores.to(DEVICE), ends.to(DEVICE), sink, budget, recent).cpu()
    if step:
        assert torch.equal(got, quest_top_reference(scores, ends, sink, budget, recent))
    else:
        assert got[0, :, sink:sink + budget].tolist() == [list(range(sink, sink + budget))] * 3
        assert got[1, :, sink:sink + budget].tolist() == [list(range(sink, sink + 24)) + list(range(64, 80))] * 3


def test_ordered_top_columns_with_ties_keep_a_top_set_in_order():
    """Tied scores at the threshold: exactly `budget` columns, none scoring below a dropped middle column,
    ascending (which of the tied columns is free: the kernel keeps the first)."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_quest import ordered_top_columns

    scores = torch.randint(-3, 3, (2, 3, 200), generator=torch.Generator().manual_seed(1)).float()
    ends, sink, budget, recent = torch.tensor([200, 150]), 8, 40, 8
    got = ordered_top_columns(scores.to(DEVICE), ends.to(DEVICE), sink, budget, recent).cpu()
    for b, end in enumerate(ends.tolist()):
        for h in range(3):
            top = got[b, h, sink:sink + budget]
            assert (top >= 0).all() and (top.diff() > 0).all()
            middle = torch.zeros(200, dtype=torch.bool)
            middle[sink:end - recent] = True
            dropped = middle.clone()
            dropped[top] = False
            assert scores[b, h, top].min() >= scores[b, h, dropped].max()
            assert got[b, h, :sink].tolist() == list(range(sink))
            assert got[b, h, sink + budget:].tolist() == list(range(end - recent, end))


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("sink, budget, recent", [(16, 128, 16), (1, 100, 1), (16, 500, 16)])
def test_two_stage_top_equals_the_one_stage_kernel(ties, sink, budget, recent):
    """A long row's top in two stages (each 2,048-column segment's top, then the row's among those candidates)
    keeps the one-stage kernel's columns: rows ending in any segment, rows whose middle holds fewer candidates
    than the budget, tied scores (the first columns kept in both), a wider segment at budget 500."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_quest import ordered_top_columns, top_segment
    from nanovllm.layers.quest import quest_top_reference

    g = torch.Generator().manual_seed(budget + ties)
    width = 4 * top_segment(1 << 20, budget) + 300
    scores = torch.randint(-4, 4, (3, 2, width), generator=g).float() if ties else torch.randn(3, 2, width, generator=g)
    ends = torch.tensor([width, width // 2 + 7, budget // 2])
    for b, end in enumerate(ends.tolist()):
        scores[b, :, end:] = float("-inf")
    scores, ends = scores.to(DEVICE), ends.to(DEVICE)
    two = ordered_top_columns(scores, ends, sink, budget, recent, stages=2)
    assert torch.equal(two, ordered_top_columns(scores, ends, sink, budget, recent, stages=1))
    if not ties:
        assert torch.equal(two.cpu(), quest_top_reference(scores.cpu(), ends.cpu(), sink, budget, recent))


def test_two_stage_top_chosen_for_few_long_rows_and_refused_for_short_ones():
    from nanovllm.kernels.triton_quest import TWO_STAGE_MAX_ROWS, top_segment

    assert top_segment(8192, 128) == 2048 and top_segment(16384, 512) == 4096
    assert top_segment(8191, 128) is None and top_segment(8192, 0) is None and top_segment(8192, 512) is None
    assert TWO_STAGE_MAX_ROWS >= 8  # batch 1 of an 8-KV-head model
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_quest import ordered_top_columns

    with pytest.raises(ValueError, match="two-stage top needs rows of at least 8192 columns"):
        ordered_top_columns(torch.zeros(1, 1, 2000, device=DEVICE), torch.tensor([2000], device=DEVICE), 1, 64, 1,
                            stages=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the selector takes the kernel only for CUDA scores")
@pytest.mark.parametrize("blocks, lengths", [(40, ([9 * 64 + 5, 30 * 64], [40 * 64 - 3])),
                                             (2080, ([600 * 64, 2080 * 64 - 3], [2060 * 64]))],
                         ids=["short-rows", "two-stage-rows"])
def test_selector_narrows_through_compiled_top_kernel_variants(blocks, lengths):
    """QuestSelector.narrow on CUDA (the ordered top kernel, one chunk for every row up to max_model_len; rows of
    8,192+ columns in two stages) keeps the columns of top-k + sort; after warm_up() rows of other widths
    compile nothing new."""
    from nanovllm.kernels.compile_watch import WATCH

    g = torch.Generator().manual_seed(3)
    num_kv_heads, group, dim, bs = 2, 4, 64, 64
    num_blocks = 2 * blocks + 10
    cache = PagedKVCache(1, num_blocks, bs, num_kv_heads, dim, torch.bfloat16, DEVICE)
    bounds = BlockKeyBounds(1, num_blocks, 0, bs, num_kv_heads, dim, DEVICE, page_size=16, dtype=torch.bfloat16)
    cache.hooks.append(bounds)
    selector = QuestSelector(bounds, 512, 0, 0, page_select=True, max_model_len=blocks * bs)
    assert selector._max_columns(bs) == 4 * blocks
    WATCH.install()
    selector.warm_up(num_kv_heads, DEVICE)
    kernels = ("_ordered_top_kernel", "_segment_top_kernel")
    top_variants = lambda: [e for e in WATCH.events if e.kernel in kernels]  # noqa: E731
    compiled = len(top_variants())
    free = torch.randperm(num_blocks, generator=g).tolist()
    for seq_lens in lengths:
        tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
        for table, n in zip(tables, seq_lens):
            keys = torch.randn(n, num_kv_heads, dim, generator=g).to(DEVICE, torch.bfloat16)
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], device=DEVICE)
            cache.write(0, keys, keys, slots)
        layout = DecodeLayout.build(SelectionInput([1] * len(seq_lens), seq_lens, bs, tables), DEVICE)
        q = torch.randn(len(seq_lens), num_kv_heads * group, dim, generator=g).to(DEVICE, torch.bfloat16)
        got = selector.narrow(0, q, num_kv_heads, layout)
        selector.ordered_top = False
        want = selector.narrow(0, q, num_kv_heads, layout)
        selector.ordered_top = True
        assert torch.equal(got, want)
        free += [b for t in tables for b in t]
    assert len(top_variants()) == compiled, [e.signature for e in top_variants()[compiled:]]


@pytest.mark.parametrize("batch, heads, width, pages", [(3, 2, 5, 1), (2, 8, 10, 1), (1, 3, 7, 4)])
@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_narrowed_tables_kernel_equals_the_reference(batch, heads, width, pages, host):
    """kernels/triton_narrowed.py against tables_and_counts on the CPU: kept positions ascending then -1
    (a row keeping fewer), host entries >= the base, counts added to what the buffer held."""
    pytest.importorskip("triton")
    from nanovllm.engine.narrowed import tables_and_counts
    from nanovllm.kernels.triton_narrowed import narrowed_tables

    g = torch.Generator().manual_seed(batch * heads + width)
    block_size, num_blocks = 64, 12
    seq_lens = [num_blocks * block_size - 5 - 40 * i for i in range(batch)]
    tables = torch.full((batch, num_blocks + 2), 7, dtype=torch.int64)  # a graph's padding past the blocks
    for i, n in enumerate(seq_lens):
        blocks = torch.randperm(50, generator=g)[: -(-n // block_size)]
        on_host = torch.rand(blocks.shape, generator=g) < 0.5 if host else torch.zeros(blocks.shape, dtype=torch.bool)
        tables[i, : len(blocks)] = torch.where(on_host, BASE + blocks, blocks)
    layout = DecodeLayout.from_tensors(tables, torch.tensor(seq_lens), block_size, BASE).at(block_size // pages)
    kept = torch.full((batch, heads, width), -1, dtype=torch.int64)
    for i in range(batch):
        for h in range(heads):
            n = width - int(torch.randint(0, 3, (1,), generator=g))
            kept[i, h, :n] = torch.randperm(int(layout.num_blocks[i]), generator=g)[:n].sort().values
    start = torch.randint(0, 100, (batch, 2), generator=g)
    want_counts, got_counts = start.clone(), start.clone().to(DEVICE)
    want = tables_and_counts(layout, kept, want_counts, BASE if host else None)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    strided = lambda t: on(torch.stack([t, -t], 1))[:, 0]  # noqa: E731  (a column of a graph's input rows)
    got = narrowed_tables(on(kept), on(layout.ids), strided(layout.seq_lens), strided(layout.num_blocks),
                          layout.block_size, got_counts, BASE if host else None)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]) and got[1].dtype == torch.int32
    assert torch.equal(got_counts.cpu(), want_counts) and (not host or bool((want_counts[:, 1] > start[:, 1]).any()))


@pytest.mark.parametrize("block_size, column_size, num_kv_heads, group, host", [
    (64, 16, 2, 3, True), (32, 16, 1, 4, False), (32, 32, 2, 2, True), (64, 64, 4, 1, True)])
@pytest.mark.parametrize("per_program", [8, 4])
@pytest.mark.parametrize("head_lse", [False, True], ids=["max", "head-lse"])
def test_candidate_max_scores_equal_the_reference(block_size, column_size, num_kv_heads, group, host, per_program,
                                                  head_lse):
    """quest_rerank's exact candidate scores from one kernel (host blocks' keys read host_delta away) against
    QuestSelector.candidate_scores' PyTorch path: -1 candidates, columns past a sequence's end, partial pages;
    the largest q . k, or each query head's log-sum-exp (quest_rerank_score "mass")."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_quest import candidate_max_scores

    g = torch.Generator().manual_seed(block_size + column_size + group)
    dim, num_blocks, num_host, base = 16, 20, 10, 1000
    keys = torch.randn(num_blocks, block_size, num_kv_heads, dim, generator=g)
    host_keys = torch.randn(num_host, block_size, num_kv_heads, dim, generator=g) if host else None
    seq_lens = [5 * block_size + 7, 3 * block_size, 2 * block_size + 1]
    blocks = [torch.randperm(num_blocks, generator=g)[: -(-n // block_size)].tolist() for n in seq_lens]
    on_host = [[host and c % 2 == 1 for c in range(len(t))] for t in blocks]
    blocks = [[c if h else b for c, (b, h) in enumerate(zip(t, f))] for t, f in zip(blocks, on_host)]
    batch = SelectionInput([1] * 3, seq_lens, block_size, blocks, on_host if host else None)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=base if host else None)
    columns = layout.ids.shape[1] * block_size // column_size
    candidates = torch.randint(-1, columns, (3, num_kv_heads, 13), generator=g)
    q = torch.randn(3, num_kv_heads * group, dim, generator=g)
    bounds = BlockKeyBounds(1, num_blocks, num_host, block_size, num_kv_heads, dim, torch.device("cpu"), page_size=16)
    selector = QuestSelector(bounds, token_budget=64, dense_layers=0, min_context=0, page_select=True, rerank=2,
                             device_keys=keys[None], host_keys=host_keys[None] if host else None)
    want_reads = torch.full((3,), 5)
    counts = torch.full((3, 3), 5, device=DEVICE)  # a column of a count buffer, as the narrowed steps pass it
    got_reads = counts[:, 2]
    want = selector.candidate_scores(0, q, layout, candidates, column_size, want_reads, head_lse=head_lse)
    got = candidate_max_scores(q.to(DEVICE), keys.to(DEVICE), host_keys.to(DEVICE) if host else None,
                               layout.ids.to(DEVICE), layout.seq_lens.to(DEVICE), candidates.to(DEVICE), block_size,
                               column_size, layout.base, per_program, key_reads=got_reads, head_lse=head_lse)
    assert want.shape == (3, num_kv_heads, *([group] if head_lse else []), 13)
    assert torch.isinf(want).any() and torch.isfinite(want).any()
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_reads.cpu(), want_reads) and bool((want_reads > 5).any()) == host  # host candidates added
    assert bool((counts[:, :2] == 5).all())
