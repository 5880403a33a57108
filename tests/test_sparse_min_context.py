"""Below sparse_min_context a sparse policy costs nothing: its steps do the work of sparse_policy "full"
(the same operations, eager and in what a decode graph captures), and Quest's key bounds, filled lazily
from the cache, are exact once a sequence grows past it."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams

BS = 16
POLICIES = ["full", "quest", "xattention", "xattention+quest"]


def engine(path, policy: str, **options) -> LLM:
    opts = dict(kvcache_block_size=BS, device="cpu", num_gpu_blocks=64, max_num_batched_tokens=256,
                sparse_policy=policy, quest_token_budget=BS, quest_dense_layers=0, xattn_block_size=16, xattn_stride=4)
    return LLM(str(path), **{**opts, **options})


def aten_ops(fn) -> Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def step_ops(llm: LLM) -> tuple[Counter, Counter, Counter]:
    """Aten ops of a prefill step (two prompts), of a decode step, and of the forward a plain decode graph
    captures (the worker's graph KV access; graphs are not captured on the CPU)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in ([5] * 90, list(range(3, 140))):
        llm.add_request(prompt, params)
    prefill = aten_ops(llm.step)
    llm.step()
    decode = aten_ops(llm.step)
    worker = llm.runner.worker
    lens = [len(s) for s in llm.scheduler.running]
    tables = [list(s.block_table) for s in llm.scheduler.running]
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)]
    meta = worker.backend.build_metadata([1] * len(lens), lens, tables, slots, BS, worker.device)
    ids, positions = torch.tensor([1] * len(lens)), torch.tensor([n - 1 for n in lens])
    with torch.inference_mode():
        graph = aten_ops(lambda: worker.model(ids, positions, worker._graph_kv(meta, "plain")))
    return prefill, decode, graph


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_steps_below_min_context_do_the_work_of_full(tiny_llama, policy):
    """Every sequence below sparse_min_context (the default 8192): no key-bound hook, no selection, no
    decode layout, no counting; the same aten operations, one for one, as the dense engine."""
    want = step_ops(engine(tiny_llama, "full"))
    got = step_ops(engine(tiny_llama, policy))
    for kind, g, w in zip(("prefill", "decode", "graph forward"), got, want):
        assert g == w, (kind, {op: g[op] - w[op] for op in g | w if g[op] != w[op]})


def quest_bounds(llm: LLM):
    selector = llm.runner.worker.selector
    return getattr(selector, "decode", selector).metadata


@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
@pytest.mark.parametrize("policy", ["quest", "xattention+quest"])
def test_lazy_key_bounds_equal_the_write_hook(tiny_llama, policy, offload):
    """Sequences that cross sparse_min_context while decoding: the lazily filled bounds of every block they
    read (device and host) equal those the write hook keeps, and so do the selections, tokens and logprobs."""
    memory = dict(num_gpu_blocks=10, enable_cpu_offload=True, cpu_kv_cache_gb=0.01) if offload else {}
    options = dict(sparse_min_context=130, max_num_batched_tokens=64, dtype="float32", quest_key_copy="none",
                   **memory)
    prompts = [list(range(3, 120)), [7] * 40 + list(range(60)), list(range(200, 60, -1))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    lazy = engine(tiny_llama, policy, **options)
    hooked = engine(tiny_llama, policy, **options)
    quest_bounds(hooked).keys = None  # the write hook keeps its bounds, on every write
    got = lazy.generate(prompts, params, use_tqdm=False)
    want = hooked.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-5
        assert g.metrics.decode_density == w.metrics.decode_density < 1
        assert g.metrics.host_kv_bytes_read == w.metrics.host_kv_bytes_read
    a, b = quest_bounds(lazy), quest_bounds(hooked)
    ready = torch.from_numpy(a.ready.nonzero()[0])
    assert len(ready) > 0
    pages = (ready[:, None] * a.pages_per_block + torch.arange(a.pages_per_block)).flatten()
    assert torch.equal(a.min[:, pages], b.min[:, pages]) and torch.equal(a.max[:, pages], b.max[:, pages])
    assert torch.equal(a.host_min, b.host_min) and torch.equal(a.host_max, b.host_max)
    if offload:
        assert torch.isfinite(a.host_min).any()


def test_lazy_bounds_are_computed_only_for_sequences_that_select(tiny_llama):
    """One sequence crosses sparse_min_context, one never does: only the first's full blocks get bounds, and
    each block's once."""
    llm = engine(tiny_llama, "quest", sparse_min_context=130)
    bounds = quest_bounds(llm)
    computed = []
    compute = bounds._compute
    bounds._compute = lambda blocks, **kw: computed.extend(blocks) or compute(blocks, **kw)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    long_seq, short_seq = list(range(3, 120)), list(range(50, 90))
    llm.generate([long_seq, short_seq], params, use_tqdm=False)
    assert len(computed) == len(set(computed)) == (len(long_seq) + 30 - 2) // BS
