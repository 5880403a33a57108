"""bf16 accuracy must not depend on memory settings: chunked and offloaded prefill of a long prompt keep
the logits error (against a float32 reference) within a small factor of the unchunked bf16 error.

Issue #14 found RULER points lost with chunking and offload; this is the CPU check that would catch a
precision loss in those paths (a partial result or LSE stored in bf16 between chunks or host pieces,
a merge in the wrong order...). bench/precision_probe.py measures the same on a real model on the GPU.
"""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM
from nanovllm.engine.offload import host_pool
from nanovllm.eval.precision import compare, prefill_tap, probe_positions

from conftest import make_tiny_model

LENGTH, BS = 2048, 16
FACTOR = 1.1  # allowed growth of the mean logits error over the unchunked bf16 run


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_long"), "qwen2", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def setup(long_model):
    prompt = torch.randint(0, 256, (LENGTH,), generator=torch.Generator().manual_seed(3)).tolist()
    positions = probe_positions(LENGTH, tail=32, stride=37)
    reference = prefill_tap(engine(long_model, "float32", max_num_batched_tokens=LENGTH), prompt, positions)
    unchunked = compare(prefill_tap(engine(long_model, "bfloat16", max_num_batched_tokens=LENGTH), prompt, positions),
                        reference)
    assert unchunked.logits_mean > 0  # bf16 really differs from float32
    return prompt, positions, reference, unchunked


def engine(path, dtype: str, **options) -> LLM:
    opts = dict(kvcache_block_size=BS, num_gpu_blocks=LENGTH // BS + 2, device="cpu", enable_prefix_caching=False)
    return LLM(str(path), dtype=dtype, **{**opts, **options})


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=64), dict(max_num_batched_tokens=256),
    dict(max_num_batched_tokens=256, enable_cpu_offload=True, num_gpu_blocks=20, cpu_kv_cache_gb=0.05),
    dict(max_num_batched_tokens=64, enable_cpu_offload=True, num_gpu_blocks=8, cpu_kv_cache_gb=0.05, ring_blocks=4),
], ids=["chunks-16", "chunks-64", "chunks-256", "offload-single-pass", "offload-split-pieces"])
def test_bf16_error_does_not_grow_with_chunking_or_offload(long_model, setup, monkeypatch, options):
    prompt, positions, reference, unchunked = setup
    ring_blocks = options.pop("ring_blocks", None)
    if ring_blocks:  # ring slots of 4 blocks: host KV attended in pieces merged by log-sum-exp
        monkeypatch.setattr(host_pool, "RING_SLOT_BYTES", ring_blocks * 2 * BS * 2 * 16 * 2)
    llm = engine(long_model, "bfloat16", **options)
    error = compare(prefill_tap(llm, prompt, positions), reference)
    if llm.runner.host_pool is not None:
        assert llm.runner.host_pool.stats.h2d_bytes > 0  # host KV was really read back
    assert error.logits_mean <= FACTOR * unchunked.logits_mean
    assert error.logits_max <= 2 * unchunked.logits_max
    for layer, (got, base) in enumerate(zip(error.attention_mean, unchunked.attention_mean)):
        assert got <= FACTOR * base, f"layer {layer}: attention error {got:.3g} vs unchunked {base:.3g}"
