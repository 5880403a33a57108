"""async_scheduling: the next step is launched before this step's tokens reach the host.

On the CPU every launch completes before it returns, so these tests check the bookkeeping (placeholder
tokens fed to the next step from the device tensor, stops one step late, prefix-cache hashing once the
tokens are real, aborts and preemption with a step in flight) against the synchronous engine.
"""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import PLACEHOLDER

BS = 16


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 50)] + \
        [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 17, 90)]


def engine(path, async_scheduling: bool, **options) -> LLM:
    opts = dict(kvcache_block_size=BS, num_gpu_blocks=128, device="cpu", max_num_batched_tokens=64)
    return LLM(str(path), async_scheduling=async_scheduling, **{**opts, **options})


def outputs(llm: LLM, batch, params):
    return [(o.token_ids, o.outputs[0].finish_reason) for o in llm.generate(batch, params, use_tqdm=False)]


def assert_all_free(llm: LLM) -> None:
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_host_blocks == 0
    assert llm._pending is None and not llm.requests
    bm.check_invariants([])


@pytest.mark.parametrize("max_tokens", [1, 2, 13])
def test_greedy_tokens_equal_synchronous(tiny_llama, monkeypatch, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=max_tokens + i, ignore_eos=True) for i in range(5)]
    want = outputs(engine(tiny_llama, False), prompts(), params)
    llm = engine(tiny_llama, True)
    launches, run = [], llm.runner.run
    monkeypatch.setattr(llm.runner, "run", lambda *a: pytest.fail("a synchronous step") or run(*a))
    launch = llm.runner.launch
    monkeypatch.setattr(llm.runner, "launch", lambda *a: launches.append(1) or launch(*a))
    assert outputs(llm, prompts(), params) == want
    assert len(launches) >= max_tokens + 4
    assert_all_free(llm)


def test_stop_tokens_stop_one_step_late_without_changing_outputs(tiny_llama):
    """Stops decided on the host arrive after the next step was launched: that token is dropped."""
    free_run = outputs(engine(tiny_llama, False), prompts(), SamplingParams(temperature=0, max_tokens=20))
    stops = sorted({ids[k] for ids, _ in free_run for k in (2, 5) if k < len(ids)})
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stops)
    want = outputs(engine(tiny_llama, False), prompts(), params)
    assert any(reason == "stop" for _, reason in want)
    llm = engine(tiny_llama, True)
    assert outputs(llm, prompts(), params) == want
    assert_all_free(llm)


def test_seeded_sampling_equals_synchronous(tiny_llama):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=10, ignore_eos=True) for s in range(5)]
    want = outputs(engine(tiny_llama, False), prompts(), params)
    assert outputs(engine(tiny_llama, True), prompts(), params) == want


def test_prefix_cache_hashes_the_real_tokens(tiny_llama):
    """A second request whose prompt is the first's prompt + output reuses its blocks and generates the
    same tokens as without async scheduling (a hash over a placeholder would break both)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        llm = engine(tiny_llama, async_scheduling)
        first = llm.generate([prompts()[4]], params, use_tqdm=False)[0]
        follow_up = llm.generate([first.prompt_token_ids + first.token_ids], params, use_tqdm=False)[0]
        results.append((first.token_ids, follow_up.token_ids, follow_up.metrics.num_cached_tokens))
    assert results[0] == results[1]
    assert results[1][2] >= 8 * BS  # 90 + 40 tokens: 8 full blocks found in the cache


def test_streamed_outputs_never_show_a_placeholder(tiny_llama):
    llm = engine(tiny_llama, True)
    ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts()]
    seen: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert PLACEHOLDER not in out.token_ids
            assert out.token_ids[: len(seen.get(out.request_id, []))] == seen.get(out.request_id, [])
            seen[out.request_id] = out.token_ids
    assert sorted(seen) == sorted(ids) and all(len(t) == 6 for t in seen.values())
    assert_all_free(llm)


def test_abort_with_a_step_in_flight_leaks_nothing(tiny_llama):
    llm = engine(tiny_llama, True)
    ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in prompts()]
    for _ in range(6):
        llm.step()
    assert llm._pending is not None
    for request_id in ids[::2]:
        llm.abort_request(request_id)
    while llm.has_unfinished_requests():
        llm.step()
    assert_all_free(llm)


def test_preemption_and_logprobs_fall_back_cleanly(tiny_llama):
    """A small pool preempts sequences with a token in flight; logprob requests run synchronously."""
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=2 if i == 1 else None)
              for i in range(5)]
    want_llm = engine(tiny_llama, False, num_gpu_blocks=14)
    want = want_llm.generate(prompts(), params, use_tqdm=False)
    llm = engine(tiny_llama, True, num_gpu_blocks=14)
    got = llm.generate(prompts(), params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].outputs[0].logprobs == want[1].outputs[0].logprobs
    assert llm.scheduler.num_preemptions > 0
    assert_all_free(llm)


def test_with_cpu_offload(tiny_llama):
    opts = dict(num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = outputs(engine(tiny_llama, False, **opts), prompts(), params)
    llm = engine(tiny_llama, True, **opts)
    assert outputs(llm, prompts(), params) == want
    assert llm.runner.host_pool.stats.d2h_bytes > 0
    assert_all_free(llm)


@pytest.mark.cuda
def test_async_in_cuda_graphs_equals_synchronous_cuda(tiny_llama):
    """On the GPU the next step's input ids come from the device inside the decode graphs, and the
    one-pass sampler draws seeded tokens without a host sync."""
    opts = dict(kvcache_block_size=BS, num_gpu_blocks=128, dtype="float32")
    params = [SamplingParams(temperature=0 if i % 2 else 0.7, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(5)]
    want = outputs(LLM(str(tiny_llama), **opts), prompts(), params)
    llm = LLM(str(tiny_llama), async_scheduling=True, **opts)
    assert outputs(llm, prompts(), params) == want
    assert llm.runner.graphs.num_replays > 0
    assert_all_free(llm)
