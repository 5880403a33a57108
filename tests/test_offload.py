"""KV-cache CPU offload through the engine: the same tokens and logprobs as without offload.

On the CPU the "device" and host pools are both RAM tensors and the copies are synchronous, which
exercises the whole orchestration (placement, copy plans, ring slots, split attention merged by LSE,
preemption when the host pool is full) in CI. The cuda-marked tests repeat it on a GPU with streams.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import HOST_BASE, is_host_block
from nanovllm.engine.offload import host_pool, staged as staged_module
from nanovllm.engine.offload.host_pool import consecutive_runs
from nanovllm.engine.offload.staged import COPIES_PER_LAYER, RING_BASE, split_runs
from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
BS = 16


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 5, 97, 64, 230, 33)]


def generate(llm: LLM, batch, params=GREEDY):
    return llm.generate(batch, params, use_tqdm=False)


def assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lp_g, lp_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lp_g.keys() == lp_w.keys()
            for t in lp_g:
                assert abs(lp_g[t] - lp_w[t]) < 1e-4


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), kvcache_block_size=BS, num_gpu_blocks=256, device="cpu")
    return generate(llm, prompts())


def offload_llm(path, ring_blocks: int | None = None, monkeypatch=None, **options) -> LLM:
    if ring_blocks is not None:  # ring slots of ring_blocks blocks of one layer's KV (tiny llama: 4 KiB each)
        monkeypatch.setattr(host_pool, "RING_SLOT_BYTES", ring_blocks * 2 * BS * 2 * 16 * 4)
    opts = dict(kvcache_block_size=BS, num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01,
                max_num_batched_tokens=64, device="cpu")
    return LLM(str(path), **{**opts, **options})


def assert_all_free(llm: LLM) -> None:
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_host_blocks == 0
    bm.check_invariants([])


def test_consecutive_runs():
    assert consecutive_runs([(3, 10), (4, 11), (5, 12), (9, 13), (10, 14), (2, 20)]) == [
        (3, 10, 3), (9, 13, 2), (2, 20, 1)]
    assert consecutive_runs([]) == []


def test_split_runs_cuts_the_longest_until_every_copy_has_a_piece():
    assert split_runs([(10, 0, 8)], 4) == [(10, 0, 2), (12, 2, 2), (14, 4, 2), (16, 6, 2)]
    assert split_runs([(10, 0, 5), (30, 5, 1)], 3) == [(10, 0, 2), (12, 2, 3), (30, 5, 1)]
    assert split_runs([(1, 0, 1), (5, 1, 1)], 4) == [(1, 0, 1), (5, 1, 1)]  # single blocks are not cut
    assert split_runs([], 4) == []
    assert split_runs([(i * 2, i, 1) for i in range(5)], 4) is None  # more runs than copies
    assert split_runs([(10, 0, 8)], 4, min_blocks=3) == [(10, 0, 4), (14, 4, 4)]  # halves of 2 would be too short
    assert split_runs([(10, 0, 5)], 4, min_blocks=3) == [(10, 0, 5)]


def decode_step(tables: list[list[int]], block_size: int = BS) -> list[ScheduledSeq]:
    """A decode step of sequences whose last token sits in the last block of each table."""
    items = []
    for table in tables:
        seq = Sequence(list(range(len(table) * block_size)), GREEDY, block_size)
        seq.block_table, seq.num_computed_tokens = list(table), len(seq) - 1
        items.append(ScheduledSeq(seq, 1))
    return items


def test_staged_copy_params_name_the_pieces(tiny_llama, monkeypatch):
    """The planner numbers a decode step's host blocks as ring positions and cuts their runs into copies;
    the (dst, src, nbytes) a decode graph's copy nodes get: each piece's blocks of that layer's host pool
    to its ring positions; copies without a piece are turned off (None)."""
    llm = offload_llm(tiny_llama, 32, monkeypatch)
    runner, o = llm.runner, llm.runner.host_pool
    step = decode_step([[0, HOST_BASE + 7, HOST_BASE + 8, 1], [HOST_BASE + 3, 2]])
    plan = runner.planner.plan(step, [])
    assert plan.block_tables == [[0, 7, 8, 1], [3, 2]] and plan.on_host == [[False, True, True, False], [True, False]]
    assert plan.staged_copies == [(7, 0, 2), (3, 2, 1)]  # tiny blocks: cutting runs would make copies < 1 MiB
    assert staged_module.ring_tables(plan.block_tables, plan.on_host) == [[0, RING_BASE, RING_BASE + 1, 1],
                                                                          [RING_BASE + 2, 2]]
    runner.planner.limits = replace(runner.planner.limits, min_copy_blocks=1)
    plan = runner.planner.plan(step, [])
    assert plan.staged_copies == [(7, 0, 1), (8, 1, 1), (3, 2, 1)]  # runs (7, 0, 2), (3, 2, 1); the first cut
    staged = runner.worker.staged
    staged.set_step(plan.staged_copies, [])
    params = staged.copy_params()
    assert len(params) == o.num_layers * 2 * COPIES_PER_LAYER
    nbytes = o.host[0, 0, 0].numel() * o.host.element_size()
    layer, kv = 1, 1
    assert params[(layer, kv, 1)] == (o.ring[kv, layer % 2, 1].data_ptr(), o.host[kv, layer, 8].data_ptr(), nbytes)
    assert params[(0, 0, 2)] == (o.ring[0, 0, 2].data_ptr(), o.host[0, 0, 3].data_ptr(), nbytes)
    assert params[(layer, kv, 3)] is None
    many = decode_step([[HOST_BASE + 2 * i for i in range(COPIES_PER_LAYER + 1)] + [0]])
    assert runner.planner.plan(many, []).staged_copies is None  # more runs than copy nodes: the split way


@pytest.mark.parametrize("staged", [True, False], ids=["staged-decode", "split-decode"])
@pytest.mark.parametrize("ring_blocks", [1, 3, 32])
def test_offload_matches_device_only(tiny_llama, reference, monkeypatch, ring_blocks, staged):
    """Six requests in 6 device blocks: most KV lives on the host, streamed in 1, 3 or 32-block pieces.
    Decode steps whose host blocks fit a slot stage them there (staged), else split attention by LSE."""
    llm = offload_llm(tiny_llama, ring_blocks, monkeypatch)
    llm.runner.staged_decode = staged
    assert llm.runner.host_pool.ring_blocks == ring_blocks
    plans = []
    plan = llm.runner.planner.plan
    monkeypatch.setattr(llm.runner.planner, "plan", lambda *a, **k: plans.append(r := plan(*a, **k)) or r)
    got = generate(llm, prompts())
    assert_same(got, reference)
    stats = llm.runner.host_pool.stats
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > stats.d2h_bytes  # history is read back every step
    staged_with_host = [p for p in plans if p.staged_copies]
    if staged and ring_blocks == 32:
        assert staged_with_host  # decode steps staged their host blocks in a slot
    if not staged:
        assert all(p.staged_copies is None for p in plans)
    assert llm.scheduler.num_preemptions == 0
    assert_all_free(llm)


def test_single_pass_is_bitwise_equal_to_device_only_with_the_same_schedule(tiny_llama, monkeypatch):
    """When the step's KV fits one ring slot, attention runs once over device + host blocks in position
    order: the very arithmetic of device-only mode (same chunks), so the logprobs are equal, not close."""
    schedule = dict(kvcache_block_size=BS, max_num_batched_tokens=16, max_num_seqs=2, device="cpu")
    want = generate(LLM(str(tiny_llama), num_gpu_blocks=256, **schedule), prompts())
    llm = offload_llm(tiny_llama, 64, monkeypatch, num_gpu_blocks=8, **schedule)
    got = generate(llm, prompts())
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.outputs[0].logprobs for g in got] == [w.outputs[0].logprobs for w in want]
    assert llm.runner.host_pool.stats.h2d_bytes > 0 and llm.scheduler.num_preemptions == 0
    assert_all_free(llm)


@pytest.mark.cuda
@pytest.mark.parametrize("ring_blocks", [1, 32])
def test_offload_matches_device_only_cuda(tiny_llama, monkeypatch, ring_blocks):
    """With copy streams and events: float32 on the GPU, most KV on the host."""
    want = generate(LLM(str(tiny_llama), kvcache_block_size=BS, num_gpu_blocks=256, dtype="float32"), prompts())
    llm = offload_llm(tiny_llama, ring_blocks, monkeypatch, device="cuda", dtype="float32")
    assert llm.runner.host_pool.host.is_pinned()
    assert_same(generate(llm, prompts()), want)
    assert llm.runner.host_pool.stats.h2d_bytes > 0
    assert llm.runner.graphs.num_replays > 0
    if ring_blocks == 32:  # decode graphs replayed with host blocks copied by their memcpy nodes
        assert llm.runner.graphs.num_staged_replays > 0
        assert any(c.version for c in llm.runner.graphs.copies.values())
    assert_all_free(llm)


@pytest.mark.parametrize("budget", [7, 16, 300])
def test_offload_with_chunk_budgets(tiny_llama, reference, budget):
    llm = offload_llm(tiny_llama, max_num_batched_tokens=budget, num_gpu_blocks=20)
    assert_same(generate(llm, prompts()), reference)
    assert_all_free(llm)


def test_one_device_block_is_enough(tiny_llama, reference):
    llm = offload_llm(tiny_llama, num_gpu_blocks=1, max_num_seqs=1)
    assert_same(generate(llm, prompts()), reference)
    assert_all_free(llm)


def test_full_host_pool_preempts_and_resumes(tiny_llama, reference):
    # 8 device + 30 host blocks cannot hold all six requests (44 blocks) at once.
    bytes_per_block = 2 * 2 * BS * 2 * 16 * 4
    llm = offload_llm(tiny_llama, cpu_kv_cache_gb=30 * bytes_per_block / 2**30, num_gpu_blocks=8)
    assert llm.block_manager.num_host_blocks == 30
    assert_same(generate(llm, prompts()), reference)
    assert llm.scheduler.num_preemptions > 0 and llm.runner.host_pool.stats.d2h_bytes > 0
    assert_all_free(llm)


def test_requests_in_sequence_equal_fresh_engines(tiny_llama):
    """No state leaks between requests: one engine serving them in turn == a fresh engine per request."""
    llm = offload_llm(tiny_llama)
    in_turn = [generate(llm, [p])[0] for p in prompts(1)]
    fresh = [generate(offload_llm(tiny_llama), [p])[0] for p in prompts(1)]
    assert_same(in_turn, fresh)
    assert_all_free(llm)


def test_prompt_logprobs_with_offload(tiny_llama):
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    batch = prompts(2)[:3]
    want = generate(LLM(str(tiny_llama), kvcache_block_size=BS, num_gpu_blocks=256, device="cpu"), batch, params)
    got = generate(offload_llm(tiny_llama, num_gpu_blocks=3), batch, params)
    for g, w in zip(got, want):
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            (ta, va), = a.items()
            (tb, vb), = b.items()
            assert ta == tb and abs(va - vb) < 1e-4


def test_request_beyond_device_plus_host_is_refused(tiny_llama, reference):
    llm = offload_llm(tiny_llama, cpu_kv_cache_gb=10 * 8192 / 2**30)  # 6 device + 10 host blocks: 256 tokens
    with pytest.raises(ValueError, match=r"needs 19 KV blocks .* has 6 device \+ 10 host blocks"):
        llm.add_request(list(range(200)), SamplingParams(max_tokens=100))
    assert_same(generate(llm, prompts()[:2]), reference[:2])  # the engine still serves
    assert_all_free(llm)


def test_blocks_really_move_to_the_host(tiny_llama):
    llm = offload_llm(tiny_llama)
    llm.add_request(prompts()[4], SamplingParams(max_tokens=4))
    seen_host = False
    while llm.has_unfinished_requests():
        llm.step()
        for seq in llm.scheduler.running:
            seen_host |= any(is_host_block(b) for b in seq.block_table)
            assert not is_host_block(seq.block_table[-1])  # the newest tokens are on the device
    assert seen_host
    assert_all_free(llm)


def test_prefix_caching_with_offload(tiny_llama, reference):
    """A second pass over the same prompts hits the cache for blocks still on the device; same outputs."""
    llm = offload_llm(tiny_llama, num_gpu_blocks=24, enable_prefix_caching=True)
    assert_same(generate(llm, prompts()), reference)
    again = generate(llm, prompts())
    assert_same(again, reference)
    assert sum(o.metrics.num_cached_tokens for o in again) >= BS
    assert llm.runner.host_pool.stats.d2h_bytes > 0
    assert_all_free(llm)


@pytest.mark.slow
def test_smollm2_greedy_with_offload_cpu(smollm2_path):
    text = open(__file__).read()[:6000]  # ~1.5K tokens of real text
    params = SamplingParams(temperature=0, max_tokens=16)
    want = generate(LLM(str(smollm2_path), device="cpu", kvcache_block_size=64, num_gpu_blocks=64), [text], params)
    llm = LLM(str(smollm2_path), device="cpu", kvcache_block_size=64, num_gpu_blocks=6, enable_cpu_offload=True,
              cpu_kv_cache_gb=0.2, max_num_batched_tokens=512)
    got = generate(llm, [text], params)
    assert got[0].token_ids == want[0].token_ids
    assert llm.runner.host_pool.stats.h2d_bytes > 0
    assert_all_free(llm)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("length", [4096, 8192])
def test_smollm2_greedy_with_offload_cuda(smollm2_path, length):
    """bf16 on the GPU with copy streams: greedy tokens equal GPU-only (eager, same chunk schedule) at 4K and
    8K with most KV on the host; the step's KV fits one ring slot, so attention is the single-pass kind."""
    schedule = dict(kvcache_block_size=256, max_num_batched_tokens=1024, enforce_eager=True)
    llm = LLM(str(smollm2_path), num_gpu_blocks=64, **schedule)
    # Real text that needs no download (the GPU machine has no network): this package's own source.
    source = sorted(Path(__file__).parent.parent.glob("nanovllm/**/*.py"))
    essay = llm.tokenizer("\n".join(p.read_text() for p in source)).input_ids
    batch = [essay[start : start + length - 64] for start in (0, length // 2, length)]
    params = SamplingParams(temperature=0, max_tokens=32)
    want = generate(llm, batch, params)
    del llm
    off = LLM(str(smollm2_path), num_gpu_blocks=12, enable_cpu_offload=True, cpu_kv_cache_gb=1.0, **schedule)
    got = generate(off, batch, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert off.runner.host_pool.stats.h2d_bytes > 0
    assert_all_free(off)
