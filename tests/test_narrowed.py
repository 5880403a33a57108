"""Narrowed decode steps (engine/narrowed.py): Quest's selection made from a decode graph's static
tensors. On the CPU the graphs are not captured, but the same KV access runs eagerly once the planner
is told it has narrowed buckets; it must equal the per-layer device selection it replaces."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.step_plan import StepPlanner, WorkerLimits
from nanovllm.engine.step_stats import DeferredStats
from nanovllm.layers.block_metadata import BlockKeyBounds
from nanovllm.layers.block_selector import DecodeLayout, SelectionInput
from nanovllm.layers.kv_access import column_tables, head_tables
from nanovllm.layers.quest import QuestSelector
from selection_helpers import positions_mask

BS = 16
BASE = 1000


def test_narrow_from_graph_tensors_equals_the_per_step_device_selection():
    """Three sequences, all past the budget, blocks on the device and the host: narrow() on a layout
    built from padded tables and lengths alone (what a graph holds) keeps the same blocks as
    decode_keep() on the layout built from the step's lists, and the per-head tables agree."""
    g = torch.Generator().manual_seed(0)
    num_kv_heads, group, dim, bs = 2, 2, 8, 32
    cache = PagedKVCache(1, 40, bs, num_kv_heads, dim, torch.float32, torch.device("cpu"))
    bounds = BlockKeyBounds(1, 40, 20, bs, num_kv_heads, dim, torch.device("cpu"), page_size=16)
    cache.hooks.append(bounds)
    seq_lens, free = [9 * bs + 5, 8 * bs + 1, 12 * bs + 20], torch.randperm(40, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    for table, n in zip(tables, seq_lens):
        keys = torch.randn(n, num_kv_heads, dim, generator=g)
        cache.write(0, keys, keys, torch.tensor([table[p // bs] * bs + p % bs for p in range(n)]))
    on_host = [[c % 3 == 1 and c < len(t) - 1 for c in range(len(t))] for t in tables]
    moves = [(b, 2 * i + c) for i, (t, f) in enumerate(zip(tables, on_host)) for c, (b, h) in enumerate(zip(t, f)) if h]
    cache.moved_to_host(moves)
    located = [[2 * i + c if h else b for c, (b, h) in enumerate(zip(t, f))] for i, (t, f) in enumerate(zip(tables, on_host))]
    batch = SelectionInput([1] * 3, seq_lens, bs, located, on_host)
    selector = QuestSelector(bounds, token_budget=3 * bs, dense_layers=0, min_context=0)
    assert selector.narrowed_decode(bs, seq_lens) and selector.narrowed_blocks(bs) == 5
    q = torch.randn(3, num_kv_heads * group, dim, generator=g)
    step = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=BASE)
    want, widest = selector.decode_keep(0, q, num_kv_heads, step)
    width = 16  # the graph's table width: past every sequence's blocks, padded with a scratch block
    padded = torch.full((3, width), 39, dtype=torch.int64)
    for i, (t, f) in enumerate(zip(located, on_host)):
        padded[i, : len(t)] = torch.tensor([BASE + b if h else b for b, h in zip(t, f)])
    graph = DecodeLayout.from_tensors(padded, torch.tensor(seq_lens, dtype=torch.int32), bs, BASE)
    kept = selector.narrow(0, q, num_kv_heads, graph)
    got = positions_mask(kept, width)
    assert torch.equal(got[:, :, : want.shape[-1]], want) and not got[:, :, want.shape[-1]:].any()
    assert widest == selector.narrowed_blocks(bs) == kept.shape[-1] and bool((kept >= 0).all())
    assert bool((kept.diff(dim=-1) > 0).all())  # ascending
    assert torch.equal(graph.on_host[:, : step.on_host.shape[1]], step.on_host)
    want_tables, want_lengths = head_tables(step, want, widest, bs)
    got_tables, got_lengths = column_tables(graph, kept, bs)
    assert torch.equal(got_tables, want_tables) and torch.equal(got_lengths, want_lengths)
    assert selector.narrow(0, q, num_kv_heads, graph) is not None
    assert QuestSelector(bounds, 3 * bs, dense_layers=1, min_context=0).narrow(0, q, num_kv_heads, graph) is None
    wide = QuestSelector(bounds, token_budget=4 * width * bs, dense_layers=0, min_context=0)  # a capture's tables
    kept = wide.narrow(0, q, num_kv_heads, graph)
    assert kept.shape[-1] == width and torch.equal(positions_mask(kept, width), graph.valid[:, None, :].expand(-1, num_kv_heads, -1))


def test_planner_narrows_only_steps_whose_every_row_is_narrowed():
    limits = WorkerLimits(BS, graph_buckets=[1, 2, 4], narrowed_buckets=[1, 2])
    planner = StepPlanner(limits)
    planner.dense_decode = lambda bs, lens: all(n < 100 for n in lens)
    planner.narrowed_decode = lambda bs, lens: all(n >= 100 for n in lens)

    class Seq:
        def __init__(self, seq_id, n):
            self.seq_id, self.token_ids, self.block_table = seq_id, [1] * n, list(range(-(-n // BS)))

        def __len__(self):
            return len(self.token_ids)

    plan = planner._decode_plan([Seq(0, 150), Seq(1, 200)], [])
    assert plan.narrowed and plan.graph_batch == 2
    plan = planner._decode_plan([Seq(0, 150), Seq(1, 50)], [])  # one row dense: per layer, eagerly
    assert not plan.narrowed and plan.graph_batch is None
    plan = planner._decode_plan([Seq(i, 150) for i in range(3)], [])  # past the narrowed buckets
    assert not plan.narrowed and plan.graph_batch is None
    plan = planner._decode_plan([Seq(0, 50)], [])
    assert not plan.narrowed and plan.graph_batch == 1


PROMPTS = [[(7 * i) % 250 + 3 for i in range(150)], [(5 * i) % 250 + 3 for i in range(97)]]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (12, 6)]


def memory_options(offload: bool) -> dict:
    return dict(num_gpu_blocks=8, enable_cpu_offload=True, cpu_kv_cache_gb=0.01) if offload else \
        dict(num_gpu_blocks=64)


def assert_same_outputs(got, want, atol: float) -> None:
    """Same tokens, logprobs within atol, same decode densities (below 1) and host bytes."""
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < atol
        assert g.metrics.decode_density == pytest.approx(w.metrics.decode_density) and g.metrics.decode_density < 1
        assert g.metrics.host_kv_bytes_read == w.metrics.host_kv_bytes_read


def quest_engine(path, narrowed: bool, **options) -> LLM:
    llm = LLM(str(path), **{**dict(kvcache_block_size=BS, device="cpu", sparse_policy="quest", sparse_min_context=0,
                                   max_num_batched_tokens=64), **options})
    if narrowed:  # what a CUDA worker's limits say; without graphs the narrowed access runs eagerly
        llm.runner.planner.limits = replace(llm.runner.planner.limits, narrowed_buckets=[1, 2, 4, 8])
    return llm


def count_narrowed_steps(llm: LLM) -> list[int]:
    seen, run = [], llm.runner.worker._narrowed_logits

    def counting(plan):
        seen.append(len(plan.seq_ids))
        return run(plan)
    llm.runner.worker._narrowed_logits = counting
    return seen


@pytest.mark.parametrize("offload, dense_layers", [(False, 0), (False, 1), (True, 0), (True, 1)],
                         ids=["device", "device-dense-layer", "offload", "offload-mirrored-layer"])
def test_narrowed_steps_equal_the_eager_device_selection(tiny_llama, offload, dense_layers):
    """Same tokens, logprobs, decode densities and host bytes as the per-layer device selection, with
    every decode step past the budget run as a narrowed step (two sequences, then one)."""
    memory = memory_options(offload)
    options = dict(quest_token_budget=2 * BS, quest_dense_layers=dense_layers, **memory)
    want = quest_engine(tiny_llama, False, **options).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = quest_engine(tiny_llama, True, **options)
    seen = count_narrowed_steps(llm)
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert seen and 2 in seen and 1 in seen
    assert_same_outputs(got, want, 1e-5)
    if offload:
        assert sum(o.metrics.host_kv_bytes_read for o in got) == llm.runner.host_pool.stats.h2d_bytes > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_launched_narrowed_steps_count_the_same_work_without_waiting(tiny_llama):
    """Under async scheduling a narrowed step's counts stay on the device when it is launched (its work is
    recorded when its tokens arrive): same tokens, decode densities and host bytes as the synchronous engine."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6)]
    options = dict(quest_token_budget=2 * BS, quest_dense_layers=1, **memory_options(True))
    sync = quest_engine(tiny_llama, True, **options)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    llm = quest_engine(tiny_llama, True, async_scheduling=True, **options)
    seen, launch, unresolved = count_narrowed_steps(llm), llm.runner.worker.launch, []

    def launching(plan):
        tokens, stats = launch(plan)
        if plan.narrowed:
            unresolved.append(isinstance(stats, DeferredStats) and stats._stats is None)
        return tokens, stats
    llm.runner.worker.launch = launching
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert seen and unresolved and all(unresolved)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.metrics.host_kv_bytes_read == w.metrics.host_kv_bytes_read
        assert g.metrics.decode_density == pytest.approx(w.metrics.decode_density) and g.metrics.decode_density < 1
    assert llm.runner.host_pool.stats.h2d_bytes == sync.runner.host_pool.stats.h2d_bytes > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("rerank, score", [(1, "max"), (2, "max"), (2, "mass")], ids=["bound", "rerank-2", "mass-2"])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload-mirrored-layer"])
def test_narrowed_page_steps_equal_the_eager_page_selection(tiny_llama, offload, rerank, score):
    """quest_page_select with 32-token blocks (2 pages each) and a 3-page budget: the narrowed steps (page
    tables over the pools viewed in pages, host pages read in place) give the eager page selection's
    tokens, logprobs, decode densities (3.5 blocks per sparse head, not a block selection's 3) and host bytes;
    with quest_rerank the same (the candidates' keys read from both pools), ranked by either score."""
    options = dict(quest_token_budget=3 * 16, quest_dense_layers=1, quest_page_select=True, kvcache_block_size=2 * BS,
                   quest_rerank=rerank, quest_rerank_score=score, **memory_options(offload))
    want = quest_engine(tiny_llama, False, **options).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = quest_engine(tiny_llama, True, **options)
    seen = count_narrowed_steps(llm)
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert seen and 2 in seen and 1 in seen and llm.runner.worker.narrowed.columns_per_block == 2
    assert_same_outputs(got, want, 1e-5)
    blocks = quest_engine(tiny_llama, False, **{**options, "quest_page_select": False}).generate(
        PROMPTS, PARAMS, use_tqdm=False)
    assert all(g.metrics.decode_density > b.metrics.decode_density for g, b in zip(got, blocks))
    if offload:
        assert sum(o.metrics.host_kv_bytes_read for o in got) == llm.runner.host_pool.stats.h2d_bytes > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_selector_swapped_in_after_capture_narrows_eagerly(tiny_llama):
    """The narrowed graphs bake in the selector and its budget: another budget must not replay them."""
    llm = quest_engine(tiny_llama, True, quest_token_budget=2 * BS, num_gpu_blocks=64)
    narrowed = llm.runner.worker.narrowed
    narrowed.capturing()

    class Graphs:
        narrowed_graphs = {1: object()}
    selector = llm.runner.worker.selector
    assert narrowed.captured(selector, 1, Graphs)
    selector.token_budget = 4 * BS
    assert not narrowed.captured(selector, 1, Graphs)
    assert not narrowed.captured(QuestSelector(selector.metadata, 2 * BS, 0, 0), 1, Graphs)
    selector.token_budget = 2 * BS
    captured_rerank = selector.rerank
    selector.rerank = captured_rerank + 1
    assert not narrowed.captured(selector, 1, Graphs)
    selector.rerank = captured_rerank
    selector.rerank_score = "mass"
    assert not narrowed.captured(selector, 1, Graphs)
    selector.rerank_score = "max"
    selector.page_select = True  # 16-token blocks: its pages are the blocks, the same narrowing
    assert narrowed.captured(selector, 1, Graphs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("pages", [dict(kvcache_block_size=BS, quest_token_budget=2 * BS),
                                   dict(kvcache_block_size=2 * BS, quest_token_budget=3 * 16, quest_page_select=True),
                                   dict(kvcache_block_size=2 * BS, quest_token_budget=3 * 16, quest_page_select=True,
                                        quest_rerank=2)],
                         ids=["blocks", "pages", "pages-rerank"])
def test_narrowed_decode_graphs_equal_eager_quest_on_cuda(tiny_llama, offload, pages):
    """The narrowed steps replayed from CUDA graphs (fp32) equal an eager engine's per-layer selection."""
    memory = memory_options(offload)
    options = dict(device="cuda", dtype="float32", sparse_policy="quest", sparse_min_context=0, quest_dense_layers=1,
                   max_num_batched_tokens=64, **pages, **memory)
    want = LLM(str(tiny_llama), enforce_eager=True, **options).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(str(tiny_llama), **options)
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.runner.worker.graphs.num_narrowed_replays > 0
    assert_same_outputs(got, want, 1e-4)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
