"""Block-sparse attention policies on the CPU: option checks, Quest's selection against a brute-force
reference, full budgets equal to dense attention, and the densities / host KV bytes each request reports."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.model_runner import _record_work
from nanovllm.engine.step_stats import resolved
from nanovllm.layers.block_metadata import BlockKeyBounds, BlockKeyCopy
from nanovllm.layers.block_selector import SelectionInput, visible_block_pairs
from nanovllm.layers.quest import QuestSelector

from conftest import DEVICES
from selection_helpers import positions_mask

BS = 16


@pytest.mark.parametrize("option, value, message", [
    ("sparse_policy", "bogus", "sparse_policy must be one of"),
    ("xattn_threshold", 0.0, r"xattn_threshold must be in \(0, 1\]"),
    ("xattn_threshold", 1.5, r"xattn_threshold must be in \(0, 1\]"),
    ("xattn_stride", 0, "xattn_stride must be a positive integer"),
    ("xattn_stride", 48, "xattn_stride=48 must divide xattn_block_size=128"),
    ("xattn_block_size", 24, "xattn_block_size must be a multiple of 16"),
    ("xattn_block_size", 96, "must divide one another"),
    ("xattn_cover", "kv", r"xattn_cover must be one of \('group', 'head'\)"),
    ("xattn_dense_last_blocks", -1, "xattn_dense_last_blocks must be an integer >= 0"),
    ("xattn_local_blocks", -2, "xattn_local_blocks must be an integer >= 0"),
    ("xattn_local_blocks", 1.5, "xattn_local_blocks must be an integer >= 0"),
    ("quest_token_budget", 0, "quest_token_budget must be a positive integer"),
    ("quest_dense_layers", -1, "quest_dense_layers must be an integer >= 0"),
    ("quest_page_select", 1, "quest_page_select must be a bool"),
    ("quest_rerank", 0, "quest_rerank must be a positive integer"),
    ("quest_rerank_score", "sum", r"quest_rerank_score must be one of \('max', 'mass'\)"),
    ("quest_key_copy", "fp4", r"quest_key_copy must be one of \('none', 'int8', 'int4'\)"),
    ("sparse_min_context", True, "sparse_min_context must be an integer >= 0"),
])
def test_bad_sparse_options_name_the_limit(tiny_llama, option, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), device="cpu", num_gpu_blocks=8, **{option: value})


def brute_force_quest(keys: torch.Tensor, q: torch.Tensor, seq_len: int, budget_blocks: int, bs: int) -> torch.Tensor:
    """keys [seq_len, Hk, D] of one sequence, q [Hq, D]: the blocks each KV head keeps, from the bounds
    computed straight from the keys (16-token pages), by the definition."""
    num_kv_heads, group = keys.shape[1], q.shape[0] // keys.shape[1]
    n = -(-seq_len // bs)
    scores = torch.full((num_kv_heads, n), float("-inf"))
    for b in range(n):
        for start in range(b * bs, min((b + 1) * bs, seq_len), 16):
            page = keys[start : min(start + 16, seq_len)].float()
            lo, hi = page.amin(0), page.amax(0)  # [Hk, D]
            for h in range(q.shape[0]):
                bound = torch.maximum(q[h].float() * hi[h // group], q[h].float() * lo[h // group]).sum()
                scores[h // group, b] = max(scores[h // group, b], bound)
    keep = torch.zeros(num_kv_heads, n, dtype=torch.bool)
    keep[:, 0] = keep[:, n - 1] = True
    for h in range(num_kv_heads):
        keep[h, 1 + scores[h, 1 : n - 1].topk(budget_blocks).indices] = True
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quest_selection_equals_brute_force(seed):
    """Random keys written through the cache's write hook (some blocks moved to the host pool), GQA 3:1,
    block size 32 with 16-token pages, a partial last block: the selection equals the definition's."""
    g = torch.Generator().manual_seed(seed)
    layers, num_kv_heads, group, dim, bs = 1, 2, 3, 8, 32
    cache = PagedKVCache(layers, 12, bs, num_kv_heads, dim, torch.float32, torch.device("cpu"))
    bounds = BlockKeyBounds(layers, 12, 6, bs, num_kv_heads, dim, torch.device("cpu"), page_size=16)
    cache.hooks.append(bounds)
    table, seq_len = [5, 2, 9, 0, 7, 11, 3], 6 * bs + 9
    keys = torch.randn(seq_len, num_kv_heads, dim, generator=g)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)])
    for start in range(0, seq_len, 20):  # written in chunks, as prefill and decode steps do
        cache.write(0, keys[start : start + 20], keys[start : start + 20], slots[start : start + 20])
    cache.moved_to_host([(2, 4), (0, 1)])  # blocks 1 and 3 of the sequence now live in host blocks 4 and 1
    located = [5, 4, 9, 1, 7, 11, 3]
    on_host = [False, True, False, True, False, False, False]
    q = torch.randn(1, num_kv_heads * group, dim, generator=g)
    selector = QuestSelector(bounds, token_budget=2 * bs, dense_layers=0, min_context=0)
    batch = SelectionInput([1], [seq_len], bs, [located], [on_host])
    got = selector.select(0, q, num_kv_heads, batch)[0]
    assert torch.equal(got, brute_force_quest(keys, q[0], seq_len, budget_blocks=2, bs=bs))
    assert got.sum(1).tolist() == [4, 4]  # sink + 2 + the most recent block, per KV head


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quest_decode_selection_on_the_device_equals_the_per_sequence_one(seed):
    """A decode batch (4 sequences of different lengths, blocks on the device and the host, one below
    min_context, one with too few blocks to drop any): decode_keep's batched masks and widths equal
    select()'s per-sequence masks with the query blocks switched on, and its table entries name host
    blocks by the second-pool offset."""
    from nanovllm.layers.block_selector import DecodeLayout, with_query_blocks

    g = torch.Generator().manual_seed(seed)
    layers, num_kv_heads, group, dim, bs = 1, 2, 3, 8, 32
    cache = PagedKVCache(layers, 40, bs, num_kv_heads, dim, torch.float32, torch.device("cpu"))
    bounds = BlockKeyBounds(layers, 40, 20, bs, num_kv_heads, dim, torch.device("cpu"), page_size=16)
    cache.hooks.append(bounds)
    seq_lens, free = [9 * bs + 5, 4 * bs + 1, 7 * bs, 12 * bs + 20], list(torch.randperm(40, generator=g).tolist())
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    for table, n in zip(tables, seq_lens):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        keys = torch.randn(n, num_kv_heads, dim, generator=g)
        cache.write(0, keys, keys, slots)
    on_host = [[c % 3 == 1 and c < len(t) - 1 for c in range(len(t))] for t in tables]
    moves = [(b, 2 * i + c) for i, (t, f) in enumerate(zip(tables, on_host)) for c, (b, h) in enumerate(zip(t, f)) if h]
    cache.moved_to_host(moves)
    located = [[2 * i + c if h else b for c, (b, h) in enumerate(zip(t, f))] for i, (t, f) in enumerate(zip(tables, on_host))]
    batch = SelectionInput([1] * 4, seq_lens, bs, located, on_host)
    q = torch.randn(4, num_kv_heads * group, dim, generator=g)
    selector = QuestSelector(bounds, token_budget=3 * bs, dense_layers=0, min_context=8 * bs)
    want = with_query_blocks(selector.select(0, q, num_kv_heads, batch), batch)
    assert [m is None for m in want] == [False, True, True, False]  # rows left whole: None
    want = [torch.ones(num_kv_heads, batch.num_blocks(i), dtype=torch.bool) if m is None else m for i, m in enumerate(want)]
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=1000)
    keep, widest = selector.decode_keep(0, q, num_kv_heads, layout)
    for i, mask in enumerate(want):
        assert torch.equal(keep[i, :, : mask.shape[1]], mask) and not keep[i, :, mask.shape[1]:].any()
    assert widest == max(int(m.sum(1).max()) for m in want) == 7  # the sequence below min_context, all 7 blocks
    assert [bool(m.all()) for m in want] == [False, True, True, False]  # 5 blocks = budget + sink + recent: all
    host_entries = layout.ids[layout.on_host]
    assert bool((host_entries >= 1000).all()) and host_entries.numel() == sum(map(sum, on_host))


@pytest.mark.parametrize("policy, prompt_lens, graphs", [
    ("quest", [40, 50], True),  # every sequence below sparse_min_context: dense, so the decode graphs
    ("quest", [40, 150], False),  # one long enough to drop blocks: selected per layer, eager
    ("xattention", [150, 150], True),  # a prefill policy: decode steps are dense
])
def test_decode_steps_a_sparse_policy_leaves_dense_are_planned_into_the_graphs(tiny_llama, policy, prompt_lens, graphs):
    """The planner asks the selector, on the host, whether a decode step attends to every block; only such
    steps get a graph bucket (the worker captures the dense graphs whatever the policy). Here the worker's
    limits are replaced by ones with graph buckets (on the CPU there are none) and the plans recorded."""
    from dataclasses import replace

    llm = LLM(str(tiny_llama), kvcache_block_size=BS, device="cpu", num_gpu_blocks=64, max_num_batched_tokens=256,
              sparse_policy=policy, sparse_min_context=100, quest_token_budget=BS, quest_dense_layers=0)
    planner, plans = llm.runner.planner, []
    planner.limits = replace(planner.limits, graph_buckets=[1, 2, 4])
    plan = planner.plan
    planner.plan = lambda *a, **k: plans.append(r := plan(*a, **k)) or r
    llm.runner.worker.execute = lambda p: llm.runner.worker.__class__.execute(llm.runner.worker, replace(p, graph_batch=None))
    prompts = [list(range(1, n + 1)) for n in prompt_lens]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    decode_plans = [p for p in plans if p.query_lens == [1, 1]]
    assert decode_plans and all((p.graph_batch == 2) == graphs for p in decode_plans)
    assert all(p.graph_batch is None for p in plans if max(p.query_lens) > 1)
    layers, heads = llm.runner.kv_shape[0], llm.runner.kv_shape[2]
    worker = llm.runner.worker
    stats = worker.work.fixed(decode_plans[0], worker.selector.dense)  # what a graph step reports: every block read
    assert [s.decode for s in stats.values()] == [(-(-n // BS) * layers * heads,) * 2 for n in decode_plans[0].seq_lens]


def quest_llm(path, **options) -> LLM:
    opts = dict(kvcache_block_size=BS, device="cpu", sparse_policy="quest", sparse_min_context=0, quest_dense_layers=0,
                max_num_batched_tokens=64)
    return LLM(str(path), **{**opts, **options})


PROMPTS = [list(range(3, 150)), [7] * 40 + list(range(60)), list(range(200, 20, -1))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def record_selections(selector) -> list:
    """Wraps selector.select: the returned list gets (batch, masks) of every call."""
    calls, select = [], selector.select

    def recording(layer, q, num_kv_heads, batch):
        masks = select(layer, q, num_kv_heads, batch)
        calls.append((batch, masks))
        return masks

    selector.select = recording
    return calls


def assert_equals_full_attention(llm_for, tiny_llama, offload: bool, density: str, device: str = "cpu") -> None:
    """llm_for(**memory) -> a sparse engine whose selection keeps every block: outputs equal full attention.
    On CUDA both engines run their decode graphs (the sparse one with its key-bound hook inside them), in fp32:
    in bf16 the offload engine's split pieces and merges alone move logprobs by ~1e-2 against device-only."""
    want = LLM(str(tiny_llama), kvcache_block_size=BS, device=device, num_gpu_blocks=64, dtype="float32",
               max_num_batched_tokens=64).generate(PROMPTS, GREEDY, use_tqdm=False)
    memory = dict(num_gpu_blocks=8, enable_cpu_offload=True, cpu_kv_cache_gb=0.01) if offload else \
        dict(num_gpu_blocks=64)
    got = llm_for(device=device, dtype="float32", **memory).generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4, (a, b)
        assert getattr(g.metrics, density) == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
@pytest.mark.parametrize("pages", [{}, dict(quest_page_select=True, kvcache_block_size=4 * BS)], ids=["blocks", "pages"])
def test_quest_with_a_budget_covering_the_context_equals_full_attention(tiny_llama, offload, device, pages):
    assert_equals_full_attention(lambda **m: quest_llm(tiny_llama, quest_token_budget=4096, **pages, **m), tiny_llama,
                                 offload, "decode_density", device)


def expected_decode_density(prompt_len: int, new_tokens: int, block_size: int, sparse_read) -> float:
    """Blocks read over blocks present in the decode steps of the tiny model (2 layers, 2 KV heads; layer 0
    dense, layer 1 reading sparse_read(n) of its n blocks per KV head)."""
    layers, heads = 2, 2
    read = present = 0
    for step in range(1, new_tokens):  # the first token comes from the prefill
        n = -(-(prompt_len + step) // block_size)
        present += layers * heads * n
        read += heads * n + heads * sparse_read(n)
    return read / present


def test_quest_decode_density_matches_an_independent_count(tiny_llama):
    """One request, budget 2 blocks: each decode step reads min(n, 2 + sink + recent) of its n blocks in
    every layer past the first (dense) one; prefill stays dense."""
    prompt, new_tokens, budget = list(range(5, 130)), 12, 2
    llm = quest_llm(tiny_llama, num_gpu_blocks=64, quest_token_budget=budget * BS, quest_dense_layers=1)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    expected = expected_decode_density(len(prompt), new_tokens, BS, lambda n: min(n, budget + 2))
    assert out.metrics.decode_density == pytest.approx(expected)
    assert out.metrics.decode_density < 1.0
    assert out.metrics.prefill_density == 1.0
    assert out.metrics.host_kv_bytes_read == 0


def test_quest_page_select_decode_density_matches_an_independent_count(tiny_llama):
    """quest_page_select, 64-token blocks (4 pages), a budget of 3 pages: each decode step's sparse layer
    reads per KV head the sink and the most recent block's 4 pages each and its 3 best pages (11 pages,
    2.75 blocks) where more than 3 pages lie between those blocks, the dense layer all n blocks."""
    prompt, new_tokens, bs = list(range(5, 205)), 12, 4 * BS
    llm = quest_llm(tiny_llama, num_gpu_blocks=16, kvcache_block_size=bs, quest_token_budget=3 * 16,
                    quest_dense_layers=1, quest_page_select=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    expected = expected_decode_density(len(prompt), new_tokens, bs, lambda n: (4 + 4 + 3) / 4 if (n - 2) * 4 > 3 else n)
    assert out.metrics.decode_density == pytest.approx(expected) and out.metrics.decode_density < 1.0


def test_quest_offload_reports_the_host_bytes_it_copies(tiny_llama):
    """In offload mode each sparse layer copies only the host blocks some KV head selected; the request's
    host_kv_bytes_read equals what the host pool counted, and is below what dense offload copies."""
    options = dict(num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = list(range(1, 200))
    sparse = quest_llm(tiny_llama, quest_token_budget=BS, **options)
    out = sparse.generate([prompt], params, use_tqdm=False)[0]
    assert out.metrics.host_kv_bytes_read == sparse.runner.host_pool.stats.h2d_bytes > 0
    dense = LLM(str(tiny_llama), kvcache_block_size=BS, device="cpu", max_num_batched_tokens=64, **options)
    dense_out = dense.generate([prompt], params, use_tqdm=False)[0]
    assert dense_out.metrics.host_kv_bytes_read == dense.runner.host_pool.stats.h2d_bytes
    assert out.metrics.host_kv_bytes_read < dense_out.metrics.host_kv_bytes_read
    assert out.metrics.decode_density < 1.0


def test_quest_dense_layers_read_their_host_kv_from_the_device_mirror(tiny_llama):
    """Offload: Quest's dense layers keep a device copy of their host blocks. With every layer dense the
    outputs equal dense offload's, and no host KV crosses to the device after the prompt, where dense
    offload copies every host block in every decode step; the mirror holds exactly the host pool's KV."""
    options = dict(num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01)
    prompt = list(range(1, 200))
    llm = quest_llm(tiny_llama, quest_token_budget=BS, quest_dense_layers=2, **options)
    got = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    dense = LLM(str(tiny_llama), kvcache_block_size=BS, device="cpu", max_num_batched_tokens=64, **options)
    want = dense.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    pool = llm.runner.host_pool
    assert pool.mirrored_layers == 2 and pool.stats.h2d_bytes == got.metrics.host_kv_bytes_read == 0
    assert want.metrics.host_kv_bytes_read > 0
    used = pool.host[:, :, :5]  # the 10 + 199 tokens (14 blocks) left 8+ blocks on the host
    assert used.abs().sum() > 0 and torch.equal(pool.mirror[:, :, :5], used)


def brute_force_xattention(q, keys, stride, granule, threshold, cover: str = "group") -> torch.Tensor:
    """The definition, with loops: [Hk, query granules, key granules] kept, for the query granules from
    the one holding the first query. q [n_q, Hq, D] are the last n_q of len(keys) positions. cover "group":
    a KV head's query heads' summed mass covers the threshold; "head": each query head's, then the union."""
    import math

    n_q, num_heads, dim = q.shape
    seq_len, num_kv_heads = keys.shape[:2]
    group, start = num_heads // num_kv_heads, seq_len - n_q
    row = {start + j: q[j].double() for j in range(n_q)}
    first_tile, key_tiles = start // stride, -(-seq_len // stride)
    first_granule = first_tile * stride // granule
    owner = (lambda h: h) if cover == "head" else (lambda h: h // group)  # whose mass a query head adds to
    mass = torch.zeros(num_heads if cover == "head" else num_kv_heads,
                       (key_tiles * stride - 1) // granule - first_granule + 1,
                       (key_tiles * stride - 1) // granule + 1, dtype=torch.float64)
    for t in range(first_tile, key_tiles):
        for h in range(num_heads):
            scores = []
            for u in range(t + 1):
                total = 0.0
                for j in range(stride):  # query row t*S + S-1-j with key row u*S + j
                    qp, kp = t * stride + stride - 1 - j, u * stride + j
                    if qp in row and kp < seq_len:
                        total += float(row[qp][h] @ keys[kp, h // group].double())
                scores.append(total / (math.sqrt(dim) * stride))
            probs = torch.tensor(scores, dtype=torch.float64).softmax(0)
            for u, p in enumerate(probs):
                mass[owner(h), t * stride // granule - first_granule, u * stride // granule] += p
    keep = torch.zeros(mass.shape, dtype=torch.bool)
    for k in range(mass.shape[0]):
        for r in range(mass.shape[1]):
            share = mass[k, r] / mass[k, r].sum()
            covered = 0.0
            for c in share.argsort(descending=True).tolist():
                if covered >= threshold or share[c] == 0:
                    break
                keep[k, r, c] = True
                covered += float(share[c])
            keep[k, r, 0] = keep[k, r, first_granule + r] = True
    return keep.view(num_kv_heads, -1, *keep.shape[1:]).any(1)


@pytest.mark.parametrize("one_copy", [False, True], ids=["flip-tiles", "one-copy-tiles"])
@pytest.mark.parametrize("cover", ["group", "head"])
@pytest.mark.parametrize("seq_len, n_q, granule", [(96, 96, 16), (150, 37, 32), (200, 64, 64)])
def test_xattention_selection_equals_brute_force(seq_len, n_q, granule, cover, one_copy):
    """GQA 2:1, stride 4, a chunk whose first query is not tile-aligned (chunked prefill); the estimate's tiles made
    either way (`one_copy_tiles`)."""
    from nanovllm.layers.xattention import XAttentionSelector

    g = torch.Generator().manual_seed(seq_len)
    keys = torch.randn(seq_len, 2, 16, generator=g) * 2
    q = torch.randn(n_q, 4, 16, generator=g) * 2
    selector = XAttentionSelector(None, None, threshold=0.8, stride=4, block_size=granule, min_context=0, cover=cover)
    selector.one_copy_tiles = one_copy
    got = selector.sequence_selection(q, keys, kv_block=granule)
    want = brute_force_xattention(q, keys, 4, granule, 0.8, cover)
    first = (seq_len - n_q) // granule
    assert torch.equal(got, want[:, :, : got.shape[2]])
    assert got.shape[1] == -(-seq_len // granule) - first
    if got.shape[2] > 4:
        assert not got.all()  # it is sparse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len, n_q", [(160, 160), (150, 37), (203, 64), (1, 1)])
def test_one_copy_tiles_equal_the_flip_and_copy_layout(seq_len, n_q, dtype):
    """key_tile_rows and the queries' tile rows made by one gather / one scaling kernel: the very tensors the
    flip-and-copy path makes (keys ragged past the last tile, queries starting mid-tile and ending mid-tile)."""
    from nanovllm.layers.xattention import antidiagonal_scores, key_tile_rows

    g = torch.Generator().manual_seed(seq_len + n_q)
    keys = (torch.randn(seq_len, 2, 16, generator=g) * 2).to(dtype)
    q = (torch.randn(n_q, 6, 16, generator=g) * 2).to(dtype)
    old, new = (key_tile_rows(keys, 4, q, one_copy) for one_copy in (False, True))
    assert new.shape == old.shape and new.is_contiguous() and torch.equal(new, old)
    (old_scores, first), (new_scores, new_first) = (antidiagonal_scores(q, keys, 4, one_copy=c) for c in (False, True))
    assert first == new_first and torch.equal(new_scores, old_scores)


@pytest.mark.parametrize("seq_len, num_queries", [(150, 120), (160, 128)], ids=["ragged", "whole-granules"])
@pytest.mark.parametrize("chunk", [16, 48, 64])
def test_xattention_estimate_in_query_chunks_equals_one_pass(chunk, seq_len, num_queries):
    """The estimate takes queries in chunks of whole granules (long contexts): the same masses as one pass
    (whole granules: the chunks that need no padding to sum per granule)."""
    from nanovllm.layers.xattention import XAttentionSelector

    g = torch.Generator().manual_seed(chunk)
    keys, q = torch.randn(seq_len, 2, 16, generator=g), torch.randn(num_queries, 4, 16, generator=g)
    selector = XAttentionSelector(None, None, threshold=0.8, stride=4, block_size=16, min_context=0)
    one_pass, first = selector.granule_mass(q, keys, 16, chunk=10**6)
    chunked, first_chunked = selector.granule_mass(q, keys, 16, chunk=chunk)
    assert first == first_chunked == (seq_len - num_queries) // 16
    torch.testing.assert_close(chunked, one_pass, atol=1e-6, rtol=1e-6)


def xattn_llm(path, **options) -> LLM:
    opts = dict(kvcache_block_size=BS, device="cpu", sparse_policy="xattention", sparse_min_context=0,
                xattn_block_size=16, xattn_stride=4, max_num_batched_tokens=64)
    return LLM(str(path), **{**opts, **options})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
def test_xattention_with_threshold_one_equals_full_attention(tiny_llama, offload, device):
    assert_equals_full_attention(lambda **m: xattn_llm(tiny_llama, xattn_threshold=1.0, **m), tiny_llama, offload,
                                 "prefill_density", device)


def test_xattention_sparse_prefill_same_device_only_and_offload(tiny_llama):
    """Threshold 0.5: prefill attends a fraction of the causal block pairs; device-only and offload (same
    chunks) give the same tokens and densities; offload reports the host bytes its pool copied (host
    blocks' K for the estimate, selected blocks' K and V for attention)."""
    schedule = dict(max_num_batched_tokens=16, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = PROMPTS[0] + PROMPTS[2]
    device = xattn_llm(tiny_llama, xattn_threshold=0.5, num_gpu_blocks=64, **schedule)
    a = device.generate([prompt], params, use_tqdm=False)[0]
    offload = xattn_llm(tiny_llama, xattn_threshold=0.5, num_gpu_blocks=8, enable_cpu_offload=True,
                        cpu_kv_cache_gb=0.01, **schedule)
    b = offload.generate([prompt], params, use_tqdm=False)[0]
    assert 0 < a.metrics.prefill_density < 1 and a.metrics.prefill_density == b.metrics.prefill_density
    assert a.token_ids == b.token_ids
    assert b.metrics.host_kv_bytes_read == offload.runner.host_pool.stats.h2d_bytes > 0


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_xattention_offload_prefill_copies_all_keys_once_and_only_selected_values(tiny_llama, threshold):
    """Offload prefill: per layer, the estimate reads K of every host block and the attention then copies
    only V of the host blocks some KV head selected (their K is already on the device). The bytes equal
    that count made from the recorded selections, and stay below dense offload's."""
    schedule = dict(max_num_batched_tokens=16, max_num_seqs=1, num_gpu_blocks=8, enable_cpu_offload=True,
                    cpu_kv_cache_gb=0.01)
    prompt, first_token = PROMPTS[0] + PROMPTS[2], SamplingParams(temperature=0, max_tokens=1)
    # cover "group": on this tiny model some query head of each group wants every block at 0.8 ("head")
    llm = xattn_llm(tiny_llama, xattn_threshold=threshold, xattn_cover="group", **schedule)
    selector = llm.runner.worker.selector
    calls = record_selections(selector)
    got = llm.generate([prompt], first_token, use_tqdm=False)[0]
    half = llm.runner.host_pool.block_bytes_per_layer // 2
    expected = 0
    for batch, masks in calls:
        host = [c for c, h in enumerate(batch.on_host[0]) if h] if batch.on_host else []
        if masks is None:
            expected += 2 * half * len(host)
            continue
        attended = masks[0].flatten(0, -2).any(0)
        expected += half * len(host) + half * sum(bool(attended[c]) for c in host)
    assert got.metrics.host_kv_bytes_read == expected == llm.runner.host_pool.stats.h2d_bytes
    dense = LLM(str(tiny_llama), kvcache_block_size=BS, device="cpu", **schedule)
    assert expected < dense.generate([prompt], first_token, use_tqdm=False)[0].metrics.host_kv_bytes_read


def test_xattention_plus_quest_uses_each_for_its_rows(tiny_llama):
    llm = LLM(str(tiny_llama), kvcache_block_size=BS, device="cpu", num_gpu_blocks=64, max_num_batched_tokens=64,
              sparse_policy="xattention+quest", sparse_min_context=0, xattn_block_size=16, xattn_stride=4,
              xattn_threshold=0.5, quest_token_budget=BS, quest_dense_layers=0)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.metrics.prefill_density < 1 and out.metrics.decode_density < 1


def test_xattention_head_cover_is_the_union_of_single_head_groups():
    """cover "head" equals covering with each query head as its own group (keys repeated per query head),
    then the union over the KV head's query heads."""
    from nanovllm.layers.xattention import XAttentionSelector

    g = torch.Generator().manual_seed(96)
    keys, q = torch.randn(96, 2, 16, generator=g) * 2, torch.randn(96, 4, 16, generator=g) * 2
    head = XAttentionSelector(None, None, 0.8, 4, 16, 0, cover="head").sequence_selection(q, keys, 16)
    group = XAttentionSelector(None, None, 0.8, 4, 16, 0, cover="group")
    single = group.sequence_selection(q, keys.repeat_interleave(2, 1), 16)
    assert torch.equal(head, single.view(2, 2, *single.shape[1:]).any(1))
    assert not torch.equal(head, group.sequence_selection(q, keys, 16))


def forced_by_definition(base: torch.Tensor, seq_len: int, first: int, kb: int, xb: int, prefill_end: int,
                         dense_last: int, local: int) -> torch.Tensor:
    """base [Hk, query blocks, blocks] with the forced blocks on, token by token: KV block r of queries attends
    to every visible block when one of its tokens lies in the prompt's last dense_last xb-token blocks, and to
    block c when c holds a key in the `local` xb-token blocks before the one of r's first token."""
    want = base.clone()
    dense_token = (-(-prefill_end // xb) - dense_last) * xb if dense_last else prefill_end
    for r in range(first, -(-seq_len // kb)):
        dense = min((r + 1) * kb, seq_len) - 1 >= dense_token
        for c in range(r + 1):
            near = local and ((c + 1) * kb - 1) // xb >= (r * kb) // xb - local
            if dense or near:
                want[:, r - first, c] = True
    return want


@pytest.mark.parametrize("kb, xb, chunks", [
    (16, 16, [(0, 64), (64, 128), (128, 150)]),  # the last 3 blocks (112-150) straddle two chunks
    (16, 16, [(96, 150)]),  # a prefix-cache hit of 6 blocks, then the rest of the prompt
    (32, 16, [(0, 70), (70, 150)]),  # KV blocks of two query blocks; a chunk boundary inside a block
    (16, 32, [(0, 100), (100, 150)]),  # query blocks of two KV blocks
])
@pytest.mark.parametrize("dense_last, local", [(3, 0), (0, 2), (2, 3)])
def test_xattention_forced_blocks_are_the_definitions(kb, xb, chunks, dense_last, local):
    """Each chunk's selection with xattn_dense_last_blocks / xattn_local_blocks equals the selection without
    them plus the blocks the definition forces (counted from the end of the prompt, not of the chunk); only
    the chunks holding the prompt's last blocks change through dense_last."""
    from nanovllm.layers.xattention import XAttentionSelector

    g = torch.Generator().manual_seed(kb + xb)
    prompt_len, num_kv_heads, dim = chunks[-1][1], 2, 16
    cache = PagedKVCache(1, 16, kb, num_kv_heads, dim, torch.float32, torch.device("cpu"))
    keys = torch.randn(prompt_len, num_kv_heads, dim, generator=g) * 2
    table = list(range(15, 15 - -(-prompt_len // kb), -1))
    cache.write(0, keys, keys, torch.tensor([table[p // kb] * kb + p % kb for p in range(prompt_len)]))
    q = torch.randn(prompt_len, 2 * num_kv_heads, dim, generator=g) * 2
    base = XAttentionSelector(cache, None, 0.1, 4, xb, 0)
    forced = XAttentionSelector(cache, None, 0.1, 4, xb, 0, dense_last_blocks=dense_last, local_blocks=local)
    changed = False
    for lo, hi in chunks:
        batch = SelectionInput([hi - lo], [hi], kb, [table], prefill_ends=[prompt_len])
        plain = base.select(0, q[lo:hi], num_kv_heads, batch)[0]
        got = forced.select(0, q[lo:hi], num_kv_heads, batch)[0]
        want = forced_by_definition(plain, hi, lo // kb, kb, xb, prompt_len, dense_last, local)
        assert torch.equal(got, want)
        changed |= not torch.equal(want, plain)
        tail = -(-prompt_len // xb) * xb - dense_last * xb  # the first token of the dense queries
        if not local and hi <= tail:
            assert torch.equal(got, plain)
        if dense_last:  # the last query blocks attend to every visible block
            for r in range(max(lo // kb, tail // kb), -(-hi // kb)):
                assert got[:, r - lo // kb, : r + 1].all()
    assert changed  # the forced blocks are not all among the estimate's


def test_xattention_keys_of_consecutive_blocks_are_a_view_of_the_cache():
    """A sequence whose blocks lie in order in the pool gets its keys as a view of the cache (no gather); any
    other order a gathered copy; both the keys written at the sequence's positions."""
    from nanovllm.layers.xattention import XAttentionSelector

    kb, seq_len, num_kv_heads, dim = 4, 14, 2, 8
    cache = PagedKVCache(1, 12, kb, num_kv_heads, dim, torch.float32, torch.device("cpu"))
    keys = torch.randn(seq_len, num_kv_heads, dim)
    selector = XAttentionSelector(cache, None, 0.5, 2, 4, 0)
    for table, view in (([3, 4, 5, 6], True), ([6, 5, 4, 3], False), ([3, 4, 6, 7], False)):
        cache.write(0, keys, keys, torch.tensor([table[p // kb] * kb + p % kb for p in range(seq_len)]))
        got = selector._keys(0, SelectionInput([seq_len], [seq_len], kb, [table]), 0)
        assert torch.equal(got, keys)
        assert (got.data_ptr() == cache.layer(0)[0][3].data_ptr()) == view


def test_xattention_dense_last_blocks_counts_from_the_prompt_end_not_the_chunk_end():
    from nanovllm.layers.xattention import XAttentionSelector

    selector = XAttentionSelector(None, None, 0.3, 4, 16, 0, dense_last_blocks=2)
    keep, table = torch.zeros(1, 4, 4, dtype=torch.bool), [[0, 1, 2, 3]]
    assert not selector.with_forced_blocks(keep, SelectionInput([64], [64], 16, table, prefill_ends=[150]), 0).any()
    end = selector.with_forced_blocks(keep, SelectionInput([64], [64], 16, table), 0)
    assert end.sum() == 3 + 4 and end[:, 2, :3].all() and end[:, 3].all()


def xattn_forced_llm(path, monkeypatch, **options) -> LLM:
    """An XAttention engine whose estimate keeps nothing: it attends to the sink, the diagonal and the forced
    blocks only."""
    from nanovllm.layers.xattention import XAttentionSelector

    monkeypatch.setattr(XAttentionSelector, "_fewest_covering",
                        lambda self, blocks: torch.zeros_like(blocks, dtype=torch.bool))
    return xattn_llm(path, **options)


def kept_by_definition(first: int, n: int, dense_from: int, local: int) -> list[list[int]]:
    """Per query block first..n-1: the sink, the diagonal, the `local` blocks before it, every block from
    dense_from on."""
    return [sorted({0, r, *range(max(0, r - local), r)} | (set(range(r + 1)) if r >= dense_from else set()))
            for r in range(first, n)]


@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
def test_xattention_forced_blocks_in_the_engine_and_their_density(tiny_llama, monkeypatch, offload):
    """Chunked prefill (64-token chunks: the prompt's last 3 blocks span two chunks), then a prompt sharing 6
    blocks with it (a prefix-cache hit, device-only): every layer's selection is exactly sink + diagonal + local window
    (fewer blocks at the sequence's start) + the last blocks dense, and prefill_density equals that count."""
    memory = dict(num_gpu_blocks=5, enable_cpu_offload=True, cpu_kv_cache_gb=0.01) if offload else \
        dict(num_gpu_blocks=64)
    llm = xattn_forced_llm(tiny_llama, monkeypatch, xattn_dense_last_blocks=3, xattn_local_blocks=2, **memory)
    selector = llm.runner.worker.selector
    calls = record_selections(selector)
    first_token = SamplingParams(temperature=0, max_tokens=1)
    prompts = [list(range(3, 153)), list(range(3, 99)) + list(range(250, 176, -1))]  # 150 tokens; 96 shared + 74
    for prompt in prompts:
        calls.clear()
        out = llm.generate([prompt], first_token, use_tqdm=False)[0]
        kept = visible = 0
        dense_from = -(-len(prompt) // BS) - 3
        for batch, masks in calls:
            first, n = batch.first_query_block(0), batch.num_blocks(0)
            want = kept_by_definition(first, n, dense_from, 2)
            assert [m.nonzero()[:, 0].tolist() for m in masks[0][0]] == want
            assert torch.equal(masks[0][0], masks[0][1])
            kept += sum(map(len, want))
            visible += sum(r + 1 for r in range(first, n))
        assert len({b.query_lens[0] for b, _ in calls}) == 2  # chunked
        # dense rows in a chunk before the prompt's last one (through SplitKV with host blocks in offload mode)
        assert any(b.seq_lens[0] < len(prompt) and b.num_blocks(0) > dense_from
                   and (not offload or any(b.on_host[0])) for b, _ in calls)
        if not offload:  # (offload moves the first prompt's blocks to the host, out of the prefix cache)
            assert out.metrics.num_cached_tokens == (0 if prompt is prompts[0] else 96)
        assert out.metrics.prefill_density == pytest.approx(kept / visible)


@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
def test_xattention_dense_last_blocks_covering_the_prompt_equals_full_attention(tiny_llama, offload):
    """Threshold 0.5 is sparse on these prompts (test_xattention_sparse_prefill_same_device_only_and_offload);
    with every query block among the dense last ones it is full attention."""
    llm_for = lambda **m: xattn_llm(tiny_llama, xattn_threshold=0.5, xattn_dense_last_blocks=16, **m)  # noqa: E731
    assert_equals_full_attention(llm_for, tiny_llama, offload, "prefill_density")


def test_xattention_forced_block_options_are_command_line_flags():
    import argparse

    from nanovllm.engine_args import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--xattn-dense-last-blocks", "2", "--xattn-local-blocks", "1"])
    assert engine_options(args) == {"xattn_dense_last_blocks": 2, "xattn_local_blocks": 1}


def test_sparse_offload_steps_dense_for_the_step_plan_their_host_pieces_once(tmp_path):
    """A prefill step under Quest (a decode policy) reads every host block in every layer: its copies are
    planned once for the step and prefetched like dense offload's, not planned again in each layer; the
    tokens and the host bytes equal dense offload's."""
    from conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "four_layers", "llama", num_hidden_layers=4)
    options = dict(kvcache_block_size=BS, device="cpu", num_gpu_blocks=6, enable_cpu_offload=True,
                   cpu_kv_cache_gb=0.01, max_num_batched_tokens=32)
    prompt, first_token = list(range(1, 150)), SamplingParams(temperature=0, max_tokens=1)
    sparse = LLM(str(path), sparse_policy="quest", sparse_min_context=0, quest_token_budget=BS,
                 quest_dense_layers=0, **options)
    worker, per_step = sparse.runner.worker, []
    build, logits = worker.backend.build_metadata, worker._logits

    def counting_build(*args, **kwargs):
        per_step[-1] += 1
        return build(*args, **kwargs)

    def counting_logits(plan):
        per_step.append(0)
        return logits(plan)

    worker.backend.build_metadata, worker._logits = counting_build, counting_logits
    got = sparse.generate([prompt], first_token, use_tqdm=False)[0]
    assert len(per_step) > 2 and max(per_step) <= 2  # the device blocks' metadata and the host pieces'
    dense = LLM(str(path), **options)
    want = dense.generate([prompt], first_token, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    assert got.metrics.host_kv_bytes_read == want.metrics.host_kv_bytes_read == sparse.runner.host_pool.stats.h2d_bytes


# ---- Quest's page selection (quest_page_select): 16-token pages instead of whole blocks ------------------------

PAGE_BS, PAGE_HK, PAGE_GROUP, PAGE_D = 64, 2, 3, 8  # 4 pages per block, GQA 3:1


def brute_force_quest_pages(keys: torch.Tensor, q: torch.Tensor, seq_len: int, budget_pages: int,
                            bs: int) -> torch.Tensor:
    """keys [seq_len, Hk, D] of one sequence, q [Hq, D]: the pages [Hk, blocks * pages per block] each KV head
    keeps, by the definition: every page of the first and the last block, and the budget's best pages
    between them by their exact upper bound (the max over the head's query heads of sum_d max(q_d * max_d,
    q_d * min_d) over the page's keys); all of them when the budget covers those pages."""
    num_kv_heads, group, per_block = keys.shape[1], q.shape[0] // keys.shape[1], bs // 16
    n = -(-seq_len // bs)
    scores = torch.full((num_kv_heads, n * per_block), float("-inf"))
    for page in range(-(-seq_len // 16)):
        part = keys[page * 16 : min(page * 16 + 16, seq_len)].float()
        lo, hi = part.amin(0), part.amax(0)
        for h in range(q.shape[0]):
            bound = torch.maximum(q[h].float() * hi[h // group], q[h].float() * lo[h // group]).sum()
            scores[h // group, page] = max(scores[h // group, page], bound)
    keep = torch.zeros(num_kv_heads, n * per_block, dtype=torch.bool)
    keep[:, :per_block] = keep[:, (n - 1) * per_block :] = True
    for h in range(num_kv_heads):
        middle = scores[h, per_block : (n - 1) * per_block]
        if middle.numel() > budget_pages:
            keep[h, per_block + middle.topk(budget_pages).indices] = True
        else:
            keep[h, per_block : (n - 1) * per_block] = True
    return keep


class PageStep:
    """A decode step of 4 sequences (one too short to drop a page) over a random cache written through the
    key-bound hook, with some full blocks moved to the host pool (offload) or not: the inputs of Quest's
    page selection and of a KV-access strategy, and each sequence's keys and values for the reference."""

    SEQ_LENS = [9 * PAGE_BS + 5, 2 * PAGE_BS + 20, 6 * PAGE_BS, 11 * PAGE_BS + 33]

    def __init__(self, seed: int, offload: bool, num_blocks: int = 40, num_host: int = 20, key_copy: bool = False):
        """key_copy: `bounds` is an int8 key copy (BlockKeyCopy, filled lazily) instead of the hook's bounds."""
        from nanovllm.engine.offload.host_pool import HostKVPool

        g = torch.Generator().manual_seed(seed)
        self.cache = PagedKVCache(1, num_blocks, PAGE_BS, PAGE_HK, PAGE_D, torch.float32, torch.device("cpu"))
        self.bounds = BlockKeyCopy(self.cache.data[0], num_host) if key_copy else \
            BlockKeyBounds(1, num_blocks, num_host, PAGE_BS, PAGE_HK, PAGE_D, torch.device("cpu"), page_size=16)
        self.cache.hooks.append(self.bounds)
        free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables = [[free.pop() for _ in range(-(-n // PAGE_BS))] for n in self.SEQ_LENS]
        self.k, self.v = [], []
        for table, n in zip(self.tables, self.SEQ_LENS):
            k, v = torch.randn(n, PAGE_HK, PAGE_D, generator=g), torch.randn(n, PAGE_HK, PAGE_D, generator=g)
            slots = torch.tensor([table[p // PAGE_BS] * PAGE_BS + p % PAGE_BS for p in range(n)])
            self.cache.write(0, k[:-1], v[:-1], slots[:-1])  # the last token is the step's
            self.k.append(k)
            self.v.append(v)
        self.slots = [t[(n - 1) // PAGE_BS] * PAGE_BS + (n - 1) % PAGE_BS for t, n in zip(self.tables, self.SEQ_LENS)]
        self.on_host = [[offload and c % 3 == 1 and c < len(t) - 1 for c in range(len(t))] for t in self.tables]
        self.pool = HostKVPool(self.cache, num_host, ring_blocks=2) if offload else None
        host_ids = iter(range(num_host))
        self.located = [[next(host_ids) if h else b for b, h in zip(t, f)] for t, f in zip(self.tables, self.on_host)]
        moves = [(b, h) for t, f, loc in zip(self.tables, self.on_host, self.located)
                 for b, on, h in zip(t, f, loc) if on]
        if moves:
            self.pool.copy_out_now(moves)
            self.cache.moved_to_host(moves)
        self.q = torch.randn(4, PAGE_HK * PAGE_GROUP, PAGE_D, generator=g)

    def selector(self, budget_pages: int) -> QuestSelector:
        return QuestSelector(self.bounds, token_budget=16 * budget_pages, dense_layers=0, min_context=0,
                             page_select=True)

    def want_keep(self, budget_pages: int) -> list[torch.Tensor]:
        return [brute_force_quest_pages(k, q, n, budget_pages, PAGE_BS) for k, q, n in zip(self.k, self.q, self.SEQ_LENS)]

    def reference(self, keeps: list[torch.Tensor], scale: float) -> torch.Tensor:
        """Each query over exactly its KV head's kept pages (float64)."""
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        for i, (k, v, keep) in enumerate(zip(self.k, self.v, keeps)):
            for h in range(PAGE_HK):
                positions = [p for page in keep[h].nonzero().flatten().tolist()
                             for p in range(page * 16, min(page * 16 + 16, len(k)))]
                kh, vh = k[positions, h].double(), v[positions, h].double()
                for qh in range(h * PAGE_GROUP, (h + 1) * PAGE_GROUP):
                    out[i, qh] = torch.softmax(kh @ self.q[i, qh].double() * scale, 0) @ vh
        return out

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([k[-1] for k in self.k]), torch.stack([v[-1] for v in self.v])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "host-blocks"])
def test_quest_page_selection_equals_brute_force(seed, offload):
    """decode_keep (the step's layout) and narrow (a graph's padded tables) keep, per KV head, exactly the
    definition's pages; the page layout names each page in the pools viewed in pages (host pages past
    the second-pool base), and reading the kept pages there gives the sequence's own tokens."""
    from nanovllm.layers.block_selector import DecodeLayout
    from nanovllm.layers.kv_access import page_views
    from nanovllm.kernels.reference import HostKV, gather_tokens

    step, budget, base = PageStep(seed, offload), 5, 1000
    step.cache.write(0, *step.new_kv(), torch.tensor(step.slots))
    batch = SelectionInput([1] * 4, step.SEQ_LENS, PAGE_BS, step.located, step.on_host)
    selector = step.selector(budget)
    assert selector.sparse_rows(PAGE_BS, step.SEQ_LENS) == [True, False, True, True]
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=base)
    keep, widest = selector.decode_keep(0, step.q, PAGE_HK, layout)
    want = step.want_keep(budget)
    for i, mask in enumerate(want):
        assert torch.equal(keep[i, :, : mask.shape[1]], mask) and not keep[i, :, mask.shape[1]:].any()
    assert widest == selector.narrowed_blocks(PAGE_BS) == budget + 2 * 4
    assert [int(m.sum(1).max()) for m in want] == [13, 12, 13, 13]
    width = 16
    padded = torch.full((4, width), 39, dtype=torch.int64)
    for i, (t, f) in enumerate(zip(step.located, step.on_host)):
        padded[i, : len(t)] = torch.tensor([base + b if h else b for b, h in zip(t, f)])
    graph = DecodeLayout.from_tensors(padded, torch.tensor(step.SEQ_LENS, dtype=torch.int32), PAGE_BS, base)
    got = positions_mask(selector.narrow(0, step.q, PAGE_HK, graph), graph.at(16).ids.shape[1])
    assert torch.equal(got[:, :, : keep.shape[-1]], keep) and not got[:, :, keep.shape[-1]:].any()
    pages = layout.at(16)
    assert pages.block_size == 16 and pages.ids.shape == (4, layout.ids.shape[1] * 4)
    assert torch.equal(graph.at(16).ids[:, : pages.ids.shape[1]][pages.valid], pages.ids[pages.valid])
    second = HostKV(step.pool.host[0, 0], step.pool.host[1, 0], base) if offload else None
    k_pages, _, host = page_views(16, *step.cache.layer(0), second)
    for i, n in enumerate(step.SEQ_LENS):
        tokens = gather_tokens(k_pages, pages.ids[i], n, host and host.k, base)
        assert torch.equal(tokens, step.k[i])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_quest_page_selection_attends_to_exactly_the_kept_pages(seed, offload):
    """A decode step through DeviceKV (device-only) or SplitKV (host blocks read in place, in pages): the
    attention equals a reference over exactly the definition's kept pages; the densities count each page
    as a quarter of its block, and the host bytes are those of the kept host pages."""
    from nanovllm.engine.offload.split import SplitKV
    from nanovllm.layers.attention import get_attention_backend
    from nanovllm.layers.block_selector import SparseStats
    from nanovllm.layers.kv_access import DeviceKV

    step, budget, scale = PageStep(seed, offload), 5, 0.3
    selector, stats, backend = step.selector(budget), SparseStats(4), get_attention_backend("torch")
    if offload:
        kv = SplitKV(step.pool, step.cache, backend, [], step.located, step.on_host, [1] * 4, step.SEQ_LENS,
                     step.slots, selector, stats)
        kv.begin()
    else:
        meta = backend.build_metadata([1] * 4, step.SEQ_LENS, step.tables, step.slots, PAGE_BS, torch.device("cpu"))
        kv = DeviceKV(step.cache, backend, meta, selector, stats)
    out = kv.attend(0, step.q, *step.new_kv(), scale)
    want = step.want_keep(budget)
    torch.testing.assert_close(out.double(), step.reference(want, scale), atol=1e-5, rtol=1e-5)
    in_place = stats.resolve()
    assert stats.decode == [[m.sum().item() / 4, m.shape[1] // 4 * PAGE_HK] for m in want]
    page_bytes = PAGE_BS * PAGE_HK * PAGE_D * 4 * 2 // PAGE_HK // 4  # K and V of one KV head's page
    host_pages = [sum(int(m[h, c * 4 + p]) for h in range(PAGE_HK) for c, host in enumerate(f) if host for p in range(4))
                  for m, f in zip(want, step.on_host)]
    assert stats.host_bytes == [n * page_bytes for n in host_pages] and in_place == sum(host_pages) * page_bytes
    assert (in_place > 0) == offload


def page_step_kv(step: PageStep, selector: QuestSelector, stats, offload: bool, query_lens: list[int],
                 seq_lens: list[int], tables: list[list[int]], located: list[list[int]], on_host: list[list[bool]],
                 slots: list[int]):
    """The step's KV access: SplitKV over located/on_host (offload), else DeviceKV over tables."""
    from nanovllm.engine.offload.split import SplitKV
    from nanovllm.layers.attention import get_attention_backend
    from nanovllm.layers.kv_access import DeviceKV

    backend = get_attention_backend("torch")
    if offload:
        kv = SplitKV(step.pool, step.cache, backend, [], located, on_host, query_lens, seq_lens, slots, selector, stats)
        kv.begin()
        return kv
    meta = backend.build_metadata(query_lens, seq_lens, tables, slots, PAGE_BS, torch.device("cpu"))
    return DeviceKV(step.cache, backend, meta, selector, stats)


class PrefillBeside:
    """A prefill chunk to put beside a PageStep's decode rows: 40 new tokens after 118 cached ones, in 3
    blocks the decode rows do not use (the first moved to host block 19 with offload)."""

    SEQ_LEN, NEW = 2 * PAGE_BS + 30, 40

    def __init__(self, step: PageStep, seed: int, offload: bool):
        g = torch.Generator().manual_seed(seed + 100)
        used = {b for t in step.tables for b in t}
        self.table = [b for b in range(40) if b not in used][:3]
        n, cached = self.SEQ_LEN, self.SEQ_LEN - self.NEW
        self.k, self.v = torch.randn(n, PAGE_HK, PAGE_D, generator=g), torch.randn(n, PAGE_HK, PAGE_D, generator=g)
        slots = [self.table[p // PAGE_BS] * PAGE_BS + p % PAGE_BS for p in range(n)]
        step.cache.write(0, self.k[:cached], self.v[:cached], torch.tensor(slots[:cached]))
        self.slots = slots[cached:]
        self.on_host = [offload, False, False]
        self.located = [19 if offload else self.table[0]] + self.table[1:]
        if offload:
            step.pool.copy_out_now([(self.table[0], 19)])
            step.cache.moved_to_host([(self.table[0], 19)])
        self.q = torch.randn(self.NEW, PAGE_HK * PAGE_GROUP, PAGE_D, generator=g)

    def reference(self, scale: float) -> torch.Tensor:
        """Causal attention of the chunk's queries over every key before them (float64)."""
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        for j in range(self.NEW):
            end = self.SEQ_LEN - self.NEW + j + 1
            for qh in range(PAGE_HK * PAGE_GROUP):
                h = qh // PAGE_GROUP
                k, v = self.k[:end, h].double(), self.v[:end, h].double()
                out[j, qh] = torch.softmax(k @ self.q[j, qh].double() * scale, 0) @ v
        return out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_mixed_step_decode_rows_select_pages_as_a_decode_step_does(seed, offload):
    """PageStep's 4 decode rows with a prefill chunk between them (sequence 2 of 5) through DeviceKV or SplitKV:
    each decode row's output equals its output in the decode-only step, and a float64 reference over exactly
    the definition's kept pages; the chunk's rows equal causal attention over their keys. The densities count
    the decode rows' pages (a quarter of a block each) and the chunk's block pairs, the host bytes the decode
    rows' kept host pages (read in place) and the chunk's whole host block (copied)."""
    from nanovllm.layers.block_selector import SparseStats, visible_block_pairs

    budget, scale = 5, 0.3
    alone = PageStep(seed, offload)
    lens = alone.SEQ_LENS
    kv = page_step_kv(alone, alone.selector(budget), None, offload, [1] * 4, lens, alone.tables, alone.located,
                      alone.on_host, alone.slots)
    decode_only = kv.attend(0, alone.q, *alone.new_kv(), scale)

    step = PageStep(seed, offload)
    chunk = PrefillBeside(step, seed, offload)
    around = lambda decode, prefill: decode[:2] + [prefill] + decode[2:]  # noqa: E731
    slots = step.slots[:2] + chunk.slots + step.slots[2:]
    stats = SparseStats(5)
    kv = page_step_kv(step, step.selector(budget), stats, offload, around([1] * 4, chunk.NEW), around(lens, chunk.SEQ_LEN),
                      around(step.tables, chunk.table), around(step.located, chunk.located),
                      around(step.on_host, chunk.on_host), slots)
    assert kv.mixed is not None
    new_k, new_v = step.new_kv()
    cached = chunk.SEQ_LEN - chunk.NEW
    cat = lambda d, p: torch.cat([d[:2], p, d[2:]])  # noqa: E731
    out = kv.attend(0, cat(step.q, chunk.q), cat(new_k, chunk.k[cached:]), cat(new_v, chunk.v[cached:]), scale)
    decode_rows = [0, 1, 2 + chunk.NEW, 3 + chunk.NEW]
    assert torch.equal(out[decode_rows], decode_only)
    want = step.want_keep(budget)
    torch.testing.assert_close(out[decode_rows].double(), step.reference(want, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2 : 2 + chunk.NEW].double(), chunk.reference(scale), atol=1e-5, rtol=1e-5)

    in_place = stats.resolve()
    pairs = visible_block_pairs(cached // PAGE_BS, 3) * PAGE_HK
    assert stats.decode == around([[m.sum().item() / 4, m.shape[1] // 4 * PAGE_HK] for m in want], [0, 0])
    assert stats.prefill == around([[0, 0]] * 4, [pairs, pairs])
    page_bytes = PAGE_BS * PAGE_HK * PAGE_D * 4 * 2 // PAGE_HK // 4  # K and V of one KV head's page
    host_pages = [sum(int(m[h, c * 4 + p]) for h in range(PAGE_HK) for c, host in enumerate(f) if host for p in range(4))
                  for m, f in zip(want, step.on_host)]
    block_bytes = PAGE_BS * PAGE_HK * PAGE_D * 4 * 2 if offload else 0
    assert stats.host_bytes == around([n * page_bytes for n in host_pages], block_bytes)
    assert in_place == sum(host_pages) * page_bytes and (in_place > 0) == offload


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_quest_page_select_decodes_alike_alone_and_beside_a_long_prefill(tiny_llama, offload, device, monkeypatch):
    """quest_page_select, 64-token blocks (4 pages), a 3-page budget, sparse_min_context=0: a request decoding
    alone and beside a 400-token prompt prefilled in 64-token chunks (mixed steps, seen through MixedRows; with
    offload through SplitKV, blocks moved to the host) gives the same tokens and logprobs (1e-5) and the same
    decode density, an independent page count (as in the decode-only test above)."""
    from nanovllm.layers.kv_access import MixedRows

    seen = []
    attend = MixedRows.attend
    monkeypatch.setattr(MixedRows, "attend", lambda self, *a: seen.append(type(self.parts[0]).__name__) or
                        attend(self, *a))
    prompt, new_tokens, bs = list(range(5, 205)), 12, 4 * BS
    memory = dict(num_gpu_blocks=8, enable_cpu_offload=True, cpu_kv_cache_gb=0.01) if offload else dict(num_gpu_blocks=64)
    options = dict(kvcache_block_size=bs, quest_token_budget=3 * 16, quest_dense_layers=1, quest_page_select=True,
                   device=device, dtype="float32", **memory)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    alone_llm = quest_llm(tiny_llama, **options)
    seen.clear()  # on CUDA the engine's start-up compiles mixed steps (engine/warm_up.py)
    alone = alone_llm.generate([prompt], params, use_tqdm=False)[0]
    assert not seen
    llm = quest_llm(tiny_llama, **options)
    seen.clear()
    long_prompt = [(7 * i) % 250 + 3 for i in range(400)]
    beside, other = llm.generate([prompt, long_prompt], [params, SamplingParams(max_tokens=1)], use_tqdm=False)
    assert len(seen) >= 5 * 2 and ("SplitKV" if offload else "DeviceKV") in seen  # 2 layers per mixed step
    assert beside.token_ids == alone.token_ids
    for a, b in zip(beside.outputs[0].logprobs, alone.outputs[0].logprobs):
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < (1e-5 if device == "cpu" else 1e-4)
    layers, heads = 2, 2
    read = present = 0
    for step in range(1, new_tokens):  # the first token comes from the prefill
        n = -(-(len(prompt) + step) // bs)
        present += layers * heads * n
        read += heads * n + heads * ((4 + 4 + 3) / 4 if (n - 2) * 4 > 3 else n)
    assert beside.metrics.decode_density == pytest.approx(read / present) == alone.metrics.decode_density
    if offload:
        read = beside.metrics.host_kv_bytes_read + other.metrics.host_kv_bytes_read
        assert read == llm.runner.host_pool.stats.h2d_bytes > 0


def test_fewest_covering_keeps_the_top_blocks_up_to_the_threshold_and_none_without_mass():
    """Per row, the fewest blocks whose mass reaches the threshold (ranked by mass), against a loop over the
    rows: blocks without mass never kept, a row without mass keeps nothing, threshold 1.0 keeps every block
    with mass."""
    from nanovllm.layers.xattention import XAttentionSelector

    g = torch.Generator().manual_seed(5)
    blocks = torch.rand(3, 6, 20, generator=g) ** 4
    blocks[0, :, 5:9] = 0.0
    blocks[1, 2] = 0.0
    for threshold in (0.5, 0.9, 0.999, 1.0):
        selector = XAttentionSelector(None, None, threshold=threshold, stride=4, block_size=16, min_context=0)
        got = selector._fewest_covering(blocks)
        for h in range(3):
            for r in range(6):
                row, want = blocks[h, r], torch.zeros(20, dtype=torch.bool)
                total, covered = float(row.sum()), 0.0
                for c in row.argsort(descending=True).tolist():
                    if row[c] == 0 or (threshold < 1.0 and covered >= threshold * total):
                        break
                    want[c], covered = True, covered + float(row[c])
                assert torch.equal(got[h, r], want), (threshold, h, r)


def brute_force_quest_rerank(keys: torch.Tensor, q: torch.Tensor, seq_len: int, budget_pages: int, bs: int,
                             rerank: int) -> torch.Tensor:
    """brute_force_quest_pages with quest_rerank: the bound's best rerank x budget middle pages are candidates,
    of which the budget's best by their exact largest score (the max over the page's keys and the KV head's
    query heads of q . k) are kept."""
    num_kv_heads, group, per_block = keys.shape[1], q.shape[0] // keys.shape[1], bs // 16
    n = -(-seq_len // bs)
    candidates = brute_force_quest_pages(keys, q, seq_len, rerank * budget_pages, bs)
    keep = candidates.clone()
    for h in range(num_kv_heads):
        middle = [p for p in range(per_block, (n - 1) * per_block) if candidates[h, p]]
        if len(middle) <= budget_pages:
            continue
        exact = torch.tensor([max(float(q[g].float() @ keys[t, h].float()) for g in range(h * group, (h + 1) * group)
                                  for t in range(p * 16, min(p * 16 + 16, seq_len))) for p in middle])
        best = {middle[i] for i in exact.topk(budget_pages).indices.tolist()}
        for p in middle:
            keep[h, p] = p in best
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "host-blocks"])
def test_quest_rerank_selection_equals_brute_force(seed, offload):
    """quest_rerank: decode_keep (the step's layout) and narrow (a graph's padded tables) keep the definition's
    pages, the candidates' keys read from the device pool or the host pool as each block lives; the choice
    differs from the bound's alone (the test can tell them apart)."""
    from nanovllm.layers.block_selector import DecodeLayout

    step, budget, base, rerank = PageStep(seed, offload), 5, 1000, 2
    step.cache.write(0, *step.new_kv(), torch.tensor(step.slots))
    selector = QuestSelector(step.bounds, token_budget=16 * budget, dense_layers=0, min_context=0, page_select=True,
                             rerank=rerank, device_keys=step.cache.data[0],
                             host_keys=step.pool.host[0] if offload else None)
    batch = SelectionInput([1] * 4, step.SEQ_LENS, PAGE_BS, step.located, step.on_host)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=base)
    key_reads = torch.zeros(4, dtype=torch.int64)
    keep, _ = selector.decode_keep(0, step.q, PAGE_HK, layout, key_reads)
    want = [brute_force_quest_rerank(k, q, n, budget, PAGE_BS, rerank) for k, q, n in zip(step.k, step.q, step.SEQ_LENS)]
    for i, mask in enumerate(want):
        assert torch.equal(keep[i, :, : mask.shape[1]], mask) and not keep[i, :, mask.shape[1]:].any()
    assert any(not torch.equal(a, b) for a, b in zip(want, step.want_keep(budget)))
    host_candidates = [candidate_pages_on_host(k, q, n, budget, rerank, flags)
                       for k, q, n, flags in zip(step.k, step.q, step.SEQ_LENS, step.on_host)]
    dropping = selector.sparse_rows(PAGE_BS, step.SEQ_LENS)  # decode_keep reads no keys for the rows it keeps whole
    assert not all(dropping) and (sum(host_candidates) > 0) == offload
    assert key_reads.tolist() == [n if d else 0 for n, d in zip(host_candidates, dropping)]
    padded = torch.full((4, 16), 39, dtype=torch.int64)
    for i, (t, f) in enumerate(zip(step.located, step.on_host)):
        padded[i, : len(t)] = torch.tensor([base + b if h else b for b, h in zip(t, f)])
    graph = DecodeLayout.from_tensors(padded, torch.tensor(step.SEQ_LENS, dtype=torch.int32), PAGE_BS, base)
    graph_reads = torch.zeros(4, dtype=torch.int64)
    got = positions_mask(selector.narrow(0, step.q, PAGE_HK, graph, graph_reads), graph.at(16).ids.shape[1])
    assert torch.equal(got[:, :, : keep.shape[-1]], keep) and not got[:, :, keep.shape[-1]:].any()
    assert graph_reads.tolist() == host_candidates  # a narrowed step's rows all drop pages: it reads them all


def candidate_pages_on_host(keys: torch.Tensor, q: torch.Tensor, seq_len: int, budget_pages: int, rerank: int,
                            on_host: list[bool]) -> int:
    """The (KV head, page) pairs of a sequence whose keys quest_rerank reads from the host pool in a step that
    reranks (its longest row holds more pages than the budget between the sink and the last block): the bound's
    rerank x budget candidates there, every page there in a row holding fewer."""
    per_block, n = PAGE_BS // 16, -(-seq_len // PAGE_BS)
    candidates = brute_force_quest_pages(keys, q, seq_len, rerank * budget_pages, PAGE_BS)
    middle = range(per_block, (n - 1) * per_block)
    return sum(bool(candidates[h, p]) and on_host[p // per_block] for h in range(keys.shape[1]) for p in middle)


def test_quest_rerank_needs_the_device_keys():
    with pytest.raises(ValueError, match="rerank=2 ranks candidates by their keys: device_keys is needed"):
        QuestSelector(PageStep(0, False).bounds, token_budget=32, dense_layers=0, min_context=0, rerank=2)


@pytest.mark.parametrize("score", ["max", "mass"])
@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
def test_quest_rerank_in_the_engine_keeps_the_budget(tiny_llama, offload, score):
    """quest_rerank=2 end to end, either score: the same decode density as the bound alone (each KV head still reads
    the budget's pages), a different choice of them on some step, and every request completes."""
    memory = dict(num_gpu_blocks=8, enable_cpu_offload=True, cpu_kv_cache_gb=0.01) if offload else dict(num_gpu_blocks=64)
    runs = {}
    for rerank in (1, 2):
        llm = quest_llm(tiny_llama, quest_token_budget=32, quest_page_select=True, kvcache_block_size=4 * BS,
                        quest_rerank=rerank, quest_rerank_score=score, quest_key_copy="none", dtype="float32",
                        **memory)
        selector, chosen = llm.runner.worker.selector, []
        narrow = selector.narrow
        selector.narrow = lambda *a: chosen.append(narrow(*a)) or chosen[-1]
        runs[rerank] = (llm.generate(PROMPTS, GREEDY, use_tqdm=False), [c for c in chosen if c is not None])
    (plain, plain_chosen), (reranked, reranked_chosen) = runs[1], runs[2]
    assert [o.metrics.decode_density for o in reranked] == [o.metrics.decode_density for o in plain]
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in reranked)
    assert plain_chosen and len(plain_chosen) == len(reranked_chosen)
    assert any(not torch.equal(a, b) for a, b in zip(plain_chosen, reranked_chosen))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompt_chunk_s_counts_are_read_once_the_next_step_is_launched(tiny_llama, async_scheduling):
    """A chunk of a prompt samples no token: the counts its sparse layers made on the device are not read at the
    chunk's end (on a GPU that waited for the whole step, the device idle until the next one was launched) but once
    the next step is launched; each chunk's pairs are then counted once, and the request's densities equal those
    of an engine that reads every step's counts at its end."""
    options = dict(kvcache_block_size=BS, device="cpu", num_gpu_blocks=64, max_num_batched_tokens=64,
                   sparse_policy="xattention", sparse_min_context=0, xattn_block_size=16, xattn_stride=4,
                   xattn_threshold=0.5, async_scheduling=async_scheduling)
    prompt, params = list(range(1, 200)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = LLM(str(tiny_llama), **options)
    layers, heads = llm.runner.kv_shape[0], llm.runner.kv_shape[2]
    llm.add_request(prompt, params)
    seq = llm.scheduler.waiting[0]
    llm.step()  # the first 64 tokens: no token sampled
    assert len(llm.runner._unread_work) == 1 and seq.prefill_blocks == [0, 0]
    llm.step()  # the next chunk launched: the first one's pairs read
    first = visible_block_pairs(0, 64 // BS) * layers * heads
    assert seq.prefill_blocks[1] == first and 0 < seq.prefill_blocks[0] <= first
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert not llm.runner._unread_work
    assert seq.prefill_blocks[1] == visible_block_pairs(0, -(-len(prompt) // BS)) * layers * heads

    at_once = LLM(str(tiny_llama), **options)
    at_once.runner._record_or_defer = lambda scheduled, stats: _record_work(scheduled, resolved(stats))
    want = at_once.generate([prompt], params, use_tqdm=False)[0]
    final = [o for o in outputs if o.finished]
    assert final and final[0].metrics.prefill_density == want.metrics.prefill_density < 1
