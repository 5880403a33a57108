"""The attention seam on the CPU: KV-access strategies with a block selector, the KV-write hook, plans.

A selector that keeps only some blocks (per KV head) must give attention equal to a reference computed
on exactly those blocks (plus the blocks that hold the queries), in device-only mode and in offload
mode, and the offload copies must move only the selected host blocks.
"""
from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICES
from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import is_host_block, HOST_BASE
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.offload.host_pool import HostKVPool
from nanovllm.engine.offload.split import SplitKV
from nanovllm.layers.attention import get_attention_backend
from nanovllm.layers.block_metadata import BlockKeyBounds
from nanovllm.layers.block_selector import (BlockSelector, SelectionInput, SinkRecentSelector, SparseStats,
                                            get_block_selector)
from nanovllm.layers.kv_access import DeviceKV

BS, HK, GROUP, D, LAYERS = 16, 2, 3, 8, 2


class RandomHeadSelector(BlockSelector):
    """A different random subset of blocks per layer and KV head (query blocks deliberately left out
    half the time: the strategies must switch them on)."""

    name = "random_heads"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.masks: dict[int, list[torch.Tensor]] = {}

    def select(self, layer, q, num_kv_heads, batch: SelectionInput):
        g = torch.Generator().manual_seed(self.seed * 100 + layer)
        masks = [torch.rand(num_kv_heads, batch.num_blocks(i), generator=g) < 0.5 for i in range(len(batch.seq_lens))]
        self.masks[layer] = masks
        return masks


class RandomRowBlocksSelector(RandomHeadSelector):
    """A different random subset per layer, KV head and block of query rows ([Hk, query blocks, blocks])."""

    def select(self, layer, q, num_kv_heads, batch: SelectionInput):
        g = torch.Generator().manual_seed(self.seed * 100 + layer)
        masks = [torch.rand(num_kv_heads, batch.num_blocks(i) - batch.first_query_block(i), batch.num_blocks(i),
                            generator=g) < 0.5 for i in range(len(batch.seq_lens))]
        self.masks[layer] = masks
        return masks


def reference(q, keys_of, masks, query_lens, seq_lens, scale) -> torch.Tensor:
    """Attention of each query over exactly the selected blocks of its sequence and head (plus its own
    block; for a [Hk, blocks] mask every block holding queries), causal by true position, in float64.
    keys_of(i) -> (k, v) [seq_len, HK, D]. masks: per sequence [HK, blocks] or [HK, query blocks, blocks]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for i, (n, seq_len) in enumerate(zip(query_lens, seq_lens)):
        k, v = keys_of(i)
        first_query_block = (seq_len - n) // BS
        for j in range(n):
            pos = seq_len - n + j
            own = pos // BS
            for h in range(HK):
                mask = masks[i][h] if masks[i].dim() == 2 else masks[i][h, own - first_query_block]
                blocks = [b for b in range(own + 1) if mask[b] or b == own or (masks[i].dim() == 2 and b >= first_query_block)]
                positions = torch.tensor([p for b in blocks for p in range(b * BS, min((b + 1) * BS, pos + 1))])
                kh, vh = k[positions, h].double(), v[positions, h].double()
                for qh in range(h * GROUP, (h + 1) * GROUP):
                    scores = (kh @ q[row + j, qh].double()) * scale
                    out[row + j, qh] = torch.softmax(scores, 0) @ vh
        row += n
    return out


def random_cache(num_blocks: int, seed: int) -> PagedKVCache:
    cache = PagedKVCache(LAYERS, num_blocks, BS, HK, D, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


# Two sequences: a decode (1 query, 5 blocks) and a prefill chunk of 20 queries spanning blocks 1-3.
QUERY_LENS, SEQ_LENS = [1, 20], [4 * BS + 5, 50]


def new_tokens(seed: int):
    g = torch.Generator().manual_seed(seed)
    t = sum(QUERY_LENS)
    return (torch.randn(t, HK * GROUP, D, generator=g), torch.randn(t, HK, D, generator=g),
            torch.randn(t, HK, D, generator=g))


def slots_of(tables: list[list[int]]) -> list[int]:
    return [tables[i][p // BS] * BS + p % BS for i, (n, s) in enumerate(zip(QUERY_LENS, SEQ_LENS))
            for p in range(s - n, s)]


def pooled_kv(pool, cache, layer, tables, on_host, seq_lens):
    """keys_of(i) for reference(): sequence i's K and V of one layer, each block from the pool it lives in."""

    def keys_of(i):
        parts = [(pool.host if h else cache.data)[:, layer, b] for b, h in zip(tables[i], on_host[i])]
        kv_tokens = torch.stack(parts, 1).flatten(1, 2)[:, : seq_lens[i]]
        return kv_tokens[0], kv_tokens[1]

    return keys_of


class RandomWithWholeRowSelector(RandomRowBlocksSelector):
    """Per query block for one sequence, None (every block) for the other, alternating by layer."""

    def select(self, layer, q, num_kv_heads, batch: SelectionInput):
        masks = super().select(layer, q, num_kv_heads, batch)
        whole = (layer + self.seed) % 2
        self.masks[layer][whole] = torch.ones(num_kv_heads, batch.num_blocks(whole), dtype=torch.bool)
        return [None if i == whole else m for i, m in enumerate(masks)]


SELECTORS = [RandomHeadSelector, RandomRowBlocksSelector, RandomWithWholeRowSelector]
SELECTOR_IDS = ["per-head", "per-head-and-query-block", "with-a-whole-row"]


@pytest.mark.parametrize("selector_class", SELECTORS, ids=SELECTOR_IDS)
@pytest.mark.parametrize("selector_seed", [0, 1, 2])
def test_device_kv_attends_to_exactly_the_selected_blocks(selector_seed, selector_class):
    cache = random_cache(12, seed=1)
    tables = [[3, 0, 7, 5, 9], [2, 4, 8, 1]]
    backend = get_attention_backend("torch")
    meta = backend.build_metadata(QUERY_LENS, SEQ_LENS, tables, slots_of(tables), BS, torch.device("cpu"))
    selector = selector_class(selector_seed)
    kv = DeviceKV(cache, backend, meta, selector)
    for layer in range(LAYERS):
        q, k, v = new_tokens(10 + layer)
        out = kv.attend(layer, q, k, v, 0.3)

        def keys_of(i):
            k_cache, v_cache = cache.layer(layer)
            return (k_cache[tables[i]].flatten(0, 1)[: SEQ_LENS[i]], v_cache[tables[i]].flatten(0, 1)[: SEQ_LENS[i]])

        want = reference(q, keys_of, selector.masks[layer], QUERY_LENS, SEQ_LENS, 0.3)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        assert any(not m.all() for m in selector.masks[layer])  # the selection really drops blocks


@pytest.mark.parametrize("selector_class", SELECTORS, ids=SELECTOR_IDS)
@pytest.mark.parametrize("ring_blocks", [1, 2, 8])
@pytest.mark.parametrize("selector_seed", [0, 3])
def test_offload_attends_and_copies_exactly_the_selected_blocks(ring_blocks, selector_seed, selector_class):
    """Host blocks (full, older than every query) mixed with device blocks; the ring holds 1, 2 or 8 blocks,
    so a layer's selected host blocks take one or several pieces."""
    cache = random_cache(10, seed=2)
    pool = HostKVPool(cache, num_host_blocks=9, ring_blocks=ring_blocks)
    pool.host.copy_(torch.randn(pool.host.shape, generator=torch.Generator().manual_seed(3)))
    tables = [[4, 6, 3, 1, 7], [2, 8, 5, 0]]  # ids within their pool
    on_host = [[True, True, False, True, False], [True, False, False, False]]
    backend = get_attention_backend("torch")
    selector = selector_class(selector_seed)
    kv = SplitKV(pool, cache, backend, [], tables, on_host, QUERY_LENS, SEQ_LENS, slots_of(tables), selector)
    kv.begin()
    assert pool.stats.h2d_bytes == 0  # nothing is prefetched: each layer copies what it selects
    expected_blocks = 0
    for layer in range(LAYERS):
        q, k, v = new_tokens(20 + layer)
        out = kv.attend(layer, q, k, v, 0.25)

        masks = selector.masks[layer]
        want = reference(q, pooled_kv(pool, cache, layer, tables, on_host, SEQ_LENS), masks, QUERY_LENS, SEQ_LENS, 0.25)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        expected_blocks += sum(1 for i in range(2) for b, h in enumerate(on_host[i]) if h and masks[i][..., b].any())
    assert pool.stats.h2d_bytes == expected_blocks * pool.block_bytes_per_layer
    assert expected_blocks < LAYERS * 4  # fewer than all host blocks of both layers


@pytest.mark.parametrize("selector_seed", [0, 1, 2])
def test_offload_decode_reads_exactly_the_selected_host_blocks_in_place(selector_seed):
    """Decode rows only: one kernel per layer over each KV head's selected blocks, host ones read where they
    are (no ring copy); the bytes counted are those of the selected (host block, KV head) pairs."""
    cache = random_cache(10, seed=4)
    pool = HostKVPool(cache, num_host_blocks=9, ring_blocks=2)
    pool.host.copy_(torch.randn(pool.host.shape, generator=torch.Generator().manual_seed(5)))
    tables, on_host = [[4, 6, 3, 1, 7], [2, 8, 5, 0]], [[True, True, False, True, False], [True, False, True, False]]
    query_lens, seq_lens = [1, 1], [4 * BS + 5, 3 * BS + 9]
    slots = [tables[i][(s - 1) // BS] * BS + (s - 1) % BS for i, s in enumerate(seq_lens)]
    selector, stats = RandomHeadSelector(selector_seed), SparseStats(2)
    kv = SplitKV(pool, cache, get_attention_backend("torch"), [], tables, on_host, query_lens, seq_lens, slots,
                 selector, stats)
    kv.begin()
    expected_pairs = [0, 0]
    for layer in range(LAYERS):
        g = torch.Generator().manual_seed(30 + layer)
        q, k, v = (torch.randn(2, h, D, generator=g) for h in (HK * GROUP, HK, HK))
        out = kv.attend(layer, q, k, v, 0.25)

        masks = selector.masks[layer]
        want = reference(q, pooled_kv(pool, cache, layer, tables, on_host, seq_lens), masks, query_lens, seq_lens, 0.25)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        for i in range(2):
            expected_pairs[i] += sum(int(masks[i][h, b]) for h in range(HK) for b, host in enumerate(on_host[i]) if host)
    head_bytes = pool.block_bytes_per_layer // HK
    assert stats.host_bytes == [n * head_bytes for n in expected_pairs]
    assert pool.stats.h2d_bytes == sum(expected_pairs) * head_bytes and pool.stats.h2d_copies == 0


def test_sparse_selection_same_in_device_only_and_offload_engines(tiny_llama):
    """Through the engine with the same chunk schedule: sink + recent blocks attended in device-only mode and
    in offload mode (most KV on the host, copied per layer) give the same tokens and logprobs."""
    schedule = dict(kvcache_block_size=BS, max_num_batched_tokens=16, max_num_seqs=2, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 97, 64)]
    results = []
    for options in (dict(num_gpu_blocks=256), dict(num_gpu_blocks=8, enable_cpu_offload=True, cpu_kv_cache_gb=0.01)):
        llm = LLM(str(tiny_llama), **schedule, **options)
        llm.runner.set_block_selector(SinkRecentSelector(sink_blocks=1, recent_blocks=2))
        results.append(llm.generate(batch, params, use_tqdm=False))
        if llm.runner.host_pool is not None:
            assert llm.runner.host_pool.stats.h2d_bytes > 0
    dense = LLM(str(tiny_llama), **schedule, num_gpu_blocks=256).generate(batch, params, use_tqdm=False)
    sparse, offloaded = results
    for a, b in zip(sparse, offloaded):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert any(a.outputs[0].logprobs != d.outputs[0].logprobs for a, d in zip(sparse, dense))  # it is sparse


def test_selectors_registry_and_limits():
    assert isinstance(get_block_selector("sink_recent", recent_blocks=3), SinkRecentSelector)
    assert get_block_selector("dense").dense
    with pytest.raises(ValueError, match="unknown block selector 'nope'"):
        get_block_selector("nope")
    with pytest.raises(ValueError, match="recent_blocks >= 1"):
        SinkRecentSelector(recent_blocks=0)


def test_key_bounds_follow_writes_and_moves_to_the_host(tiny_llama):
    """The KV-write hook keeps per-block key min/max right for every block of every running sequence,
    on the device and after blocks moved to the host (where the bounds move with them)."""
    llm = LLM(str(tiny_llama), kvcache_block_size=BS, num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01,
              max_num_batched_tokens=40, device="cpu")
    cache, pool = llm.runner.kv_cache, llm.runner.host_pool
    bounds = BlockKeyBounds(LAYERS, cache.data.shape[2], pool.num_host_blocks, BS, cache.num_kv_heads,
                            cache.data.shape[-1], cache.data.device)
    cache.hooks.append(bounds)
    g = torch.Generator().manual_seed(9)
    for n in (70, 45):
        llm.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams(max_tokens=20))
    checked_host = checked_device = 0
    while llm.has_unfinished_requests():
        llm.step()
        for seq in llm.scheduler.running:
            for i, block in enumerate(seq.block_table):
                filled = min(BS, seq.num_computed_tokens - i * BS)
                if filled <= 0:
                    continue
                for layer in range(LAYERS):
                    if is_host_block(block):
                        keys, lo, hi = pool.host[0, layer, block - HOST_BASE], bounds.host_min, bounds.host_max
                        b = block - HOST_BASE
                        checked_host += 1
                    else:
                        keys, lo, hi, b = cache.data[0, layer, block], bounds.min, bounds.max, block
                        checked_device += 1
                    assert torch.equal(lo[layer, b], keys[:filled].amin(0)) and torch.equal(hi[layer, b], keys[:filled].amax(0))
    assert checked_host > 0 and checked_device > 0


def test_step_plans_are_plain_and_picklable(tiny_llama):
    """Plans carry explicit block locations and survive pickling (what N workers would receive)."""
    llm = LLM(str(tiny_llama), kvcache_block_size=BS, num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01,
              max_num_batched_tokens=64, device="cpu")
    plans = []
    plan = llm.runner.planner.plan
    llm.runner.planner.plan = lambda *a, **k: plans.append(r := plan(*a, **k)) or r
    llm.generate([list(range(1, 150)), list(range(3, 40))], SamplingParams(max_tokens=5), use_tqdm=False)
    assert any(p.has_host_blocks for p in plans) and any(p.offloads for p in plans)
    for p in plans:
        copy = pickle.loads(pickle.dumps(p))
        assert copy == p
        assert all(b < HOST_BASE for t in p.block_tables for b in t)  # ids within their pool, never encoded
        assert len(p.on_host) == len(p.block_tables) == len(p.query_lens)


class HostReadsOnCuda(TorchDispatchMode):
    """On the CPU, records the ops that would make the host wait for a CUDA device: a value read back
    (item), a size known only from the data (nonzero, boolean-mask indexing, repeat_interleave without
    output_size, unique), and an index_put whose value is a 0-dim tensor (a Python scalar, copied from the
    host first). The CPU stand-in for torch.cuda.set_sync_debug_mode("error"); .tolist() and .cpu() are not
    dispatched and are caught on the GPU only."""

    SIZE_FROM_DATA = {"aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense", "aten::is_nonzero",
                      "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::equal"}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in self.SIZE_FROM_DATA:
            self.found.append(name)
        elif name == "aten::index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.found.append("aten::index (boolean mask)")
        elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None and len(args) == 1:
            self.found.append("aten::repeat_interleave (no output_size)")
        elif name in ("aten::index_put_", "aten::index_put") and args[2].dim() == 0:
            self.found.append("aten::index_put (host scalar value)")
        return func(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["xattention", "quest"])
def test_sparse_prefill_layer_makes_no_host_sync(policy, device):
    """A sparse layer of a mixed step (a prefill chunk beside a decode row) queues its work without reading
    anything back from the device: a sync per layer left the GPU idle while the host built the next one.
    On CUDA torch's sync debug mode raises at the op; on the CPU HostReadsOnCuda lists such ops."""
    from nanovllm.layers.quest import QuestSelector
    from nanovllm.layers.xattention import XAttentionSelector

    device, bs, blocks = torch.device(device), 64, 40
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = PagedKVCache(1, blocks, bs, HK, 64, dtype, device)
    cache.data.normal_()
    if policy == "quest":
        bounds = BlockKeyBounds(1, blocks, 0, bs, HK, 64, device, page_size=16, dtype=dtype)
        cache.hooks.append(bounds)
        selector = QuestSelector(bounds, token_budget=2 * bs, dense_layers=0, min_context=0)
    else:
        selector = XAttentionSelector(cache, None, threshold=0.5, stride=8, block_size=64, min_context=0)
    backend = get_attention_backend("triton" if device.type == "cuda" else "torch")
    query_lens, seq_lens = [200, 1], [700, 900]
    tables = [list(range(11)), list(range(11, 26))]
    slots = [tables[0][p // bs] * bs + p % bs for p in range(500, 700)] + [tables[1][899 // bs] * bs + 899 % bs]
    q, k, v = (torch.randn(201, h, 64, device=device, dtype=dtype) for h in (HK * GROUP, HK, HK))
    for check in (False, True):  # the first call compiles the kernels
        stats = SparseStats(2)
        kv = DeviceKV(cache, backend, backend.build_metadata(query_lens, seq_lens, tables, slots, bs, device),
                      selector, stats)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if check else 0)
            try:
                kv.attend(0, q, k, v, 0.125)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            with HostReadsOnCuda() as watch:
                kv.attend(0, q, k, v, 0.125)
            assert watch.found == []
        stats.resolve()
        narrowed = stats.decode[1] if policy == "quest" else stats.prefill[0]  # Quest narrows decode rows only
        assert 0 < narrowed[0] < narrowed[1]


def test_a_sparse_steps_layers_share_their_metadata_plans(tiny_llama):
    """The per-KV-head metadata of one step's sparse layers share the backend's plans (kernel work schedules,
    built once per step on the GPU) and the query offsets: same query counts and length bounds in every
    layer. Another step gets its own."""
    llm = LLM(str(tiny_llama), kvcache_block_size=BS, num_gpu_blocks=64, max_num_batched_tokens=64, device="cpu",
              sparse_policy="xattention", sparse_min_context=0, xattn_block_size=16, xattn_stride=4,
              xattn_threshold=0.5)
    backend, seen = llm.runner.worker.backend, []
    forward = backend.forward

    def recording(q, k_cache, v_cache, meta, scale, *rest):
        if meta.block_tables_tensor.dim() == 3:
            seen.append(meta)
        return forward(q, k_cache, v_cache, meta, scale, *rest)

    backend.forward = recording
    llm.generate([list(range(3, 150))], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    layers = llm.runner.worker.model.config.num_layers
    assert len(seen) >= 2 * layers  # several chunks of 64 tokens, each a sparse step
    for step in range(len(seen) // layers):
        metas = seen[step * layers : (step + 1) * layers]
        assert all(m.plans is metas[0].plans and m.cu_query_lens is metas[0].cu_query_lens for m in metas)
    assert seen[0].plans is not seen[layers].plans
