"""Scheduling choices must not change greedy tokens: chunking, prefix hits, preemption, batching."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (70,), generator=g).tolist()
    tails = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 30, 1)]
    return [shared + t for t in tails] + [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 45, 120)]


def run(path, batch, **options):
    llm = LLM(str(path), kvcache_block_size=16, device="cpu", **{"num_gpu_blocks": 128, **options})
    return llm, [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Whole prefill, no prefix caching, one request at a time."""
    llm = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=128, max_num_batched_tokens=4096,
              enable_prefix_caching=False, device="cpu")
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts()]


def test_batch_equals_one_at_a_time(tiny_llama, reference):
    _, got = run(tiny_llama, prompts(), max_num_batched_tokens=4096, enable_prefix_caching=False)
    assert got == reference


@pytest.mark.parametrize("budget", [1, 7, 16, 50])
def test_chunked_prefill_equals_whole(tiny_llama, reference, budget):
    _, got = run(tiny_llama, prompts(), max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert got == reference


def test_prefix_cache_hit_equals_cold_start(tiny_llama, reference):
    llm, first = run(tiny_llama, prompts())
    assert first == reference
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)  # second pass: prompts now cached
    assert [o.token_ids for o in outs] == reference
    assert outs[1].metrics.num_cached_tokens >= 64  # the shared 70-token prefix gives 4 full blocks
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_preempted_and_recomputed_equals_reference(tiny_llama, reference):
    # 12 blocks of 16 tokens cannot hold all six requests at once: some get preempted.
    llm, got = run(tiny_llama, prompts(), num_gpu_blocks=12, max_num_batched_tokens=64)
    assert llm.scheduler.num_preemptions > 0
    assert got == reference
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
