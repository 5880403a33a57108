"""Tensor parallelism on the CPU: 2 gloo processes against one, start-up errors, failures and shut-down.

Each engine with tensor_parallel_size=2 spawns one worker process (a few seconds): one engine per case,
several requests and two generate() calls each.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import make_tiny_model
from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.config import load_hf_config
from nanovllm.distributed.executor import TEST_FAIL_ENV, TensorParallelError
from nanovllm.distributed.parallel_state import TensorParallel
from nanovllm.models.loader import build_model

BS = 16
CASES = {
    "llama": ("llama", {}),  # 2 KV heads: one per rank
    "qwen2-1kv-tied": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),  # the KV head replicated
    "qwen3-odd-vocab": ("qwen3", {"head_dim": 32, "vocab_size": 251}),  # vocabulary split 126 + 125
    # SmolLM2's heads (9 over 3 KV heads): KV heads 2 + 1 with their query heads, MLP columns 65 + 64
    "llama-uneven": ("llama", {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 144,
                               "intermediate_size": 129}),
}
MEMORY = {
    "device": dict(num_gpu_blocks=64),
    "offload": dict(num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01),
}
COMMON = dict(kvcache_block_size=BS, device="cpu", dtype="float32", max_num_batched_tokens=32, async_scheduling=True)
PREFIX = list(range(10, 50))
PROMPTS = [PREFIX + [3, 4], PREFIX + [200, 7, 9], list(range(150, 40, -1)), [5]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {case: make_tiny_model(tmp_path_factory.mktemp(case), arch, **overrides)
            for case, (arch, overrides) in CASES.items()}


def spawned_children() -> list[psutil.Process]:
    """This process's multiprocessing children started with spawn (not the resource tracker)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def run(llm: LLM) -> list:
    """A logprobs step (synchronous, with prompt logprobs), then the same prompts without (asynchronous
    launches, prefix-cache hits), each with chunked prefill of the long prompt."""
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate(PROMPTS, with_logprobs, use_tqdm=False) + llm.generate(PROMPTS, plain, use_tqdm=False)


def assert_close_logprobs(got: list[dict[int, float]] | None, want: list[dict[int, float]] | None) -> None:
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or []):
        if w is None:
            assert g is None
            continue
        assert g.keys() == w.keys()
        assert max(abs(g[t] - w[t]) for t in w) < 1e-4


def assert_same_outputs(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert_close_logprobs(g.outputs[0].logprobs, w.outputs[0].logprobs)
        assert_close_logprobs(g.prompt_logprobs, w.prompt_logprobs)
        assert g.metrics.num_cached_tokens == w.metrics.num_cached_tokens


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_one(models, case, memory):
    options = {**COMMON, **MEMORY[memory]}
    one = LLM(str(models[case]), **options)
    want = run(one)
    with LLM(str(models[case]), tensor_parallel_size=2, **options) as two:
        assert len(spawned_children()) == 1
        assert two.block_manager.num_blocks == one.block_manager.num_blocks
        assert two.runner.kv_cache.num_kv_heads == max(1, -(-one.runner.kv_cache.num_kv_heads // 2))  # rank 0's
        if memory == "offload":  # cpu_kv_cache_gb is shared by the ranks
            assert two.block_manager.num_host_blocks == int(0.01 * 2**30 / 2 // two.runner.bytes_per_block)
        got = run(two)
        assert two.block_manager.num_used_blocks == 0
    assert spawned_children() == []  # leaving the with block shut the worker down
    two.shutdown()
    assert_same_outputs(got, want)
    assert got[len(PROMPTS) + 1].metrics.num_cached_tokens >= len(PREFIX) // BS * BS  # the second call hit the cache
    if memory == "offload":
        assert two.runner.host_pool.stats.h2d_bytes > 0


def test_smollm2_two_ranks_match_one(smollm2_path):
    """SmolLM2-135M's own weights in fp32 (issue #20's check, here over gloo): its 9 query heads over 3 KV heads split
    6 + 3 (KV heads 2 + 1), its MLP 768 + 768 columns; greedy tokens equal, logprobs within 1e-4."""
    prompts = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:", "1, 2, 3, 5, 8,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    options = dict(device="cpu", dtype="float32", max_model_len=512, num_gpu_blocks=16)
    want = LLM(str(smollm2_path), **options).generate(prompts, params, use_tqdm=False)
    with LLM(str(smollm2_path), tensor_parallel_size=2, **options) as two:
        assert (two.runner.model.config.num_heads, two.runner.kv_cache.num_kv_heads) == (6, 2)  # rank 0's share
        got = two.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert_close_logprobs(g.outputs[0].logprobs, w.outputs[0].logprobs)


@pytest.mark.parametrize("host_keys", ["host", "copy"])
def test_sparse_attention_with_offload_per_rank_heads(models, host_keys):
    """XAttention prefill and Quest decode select per KV head: each rank selects over its own head, which
    is the selection one rank makes for that head (host pages' keys read over PCIe or from each rank's own
    key copy, quest_host_keys)."""
    options = dict(COMMON, num_gpu_blocks=8, enable_cpu_offload=True, cpu_kv_cache_gb=0.01,
                   sparse_policy="xattention+quest", sparse_min_context=0, xattn_block_size=16, xattn_stride=4,
                   xattn_threshold=0.5, quest_token_budget=BS, quest_dense_layers=0, quest_host_keys=host_keys)
    prompts = [list(range(3, 150)), list(range(200, 20, -1))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = LLM(str(models["llama"]), **options).generate(prompts, params, use_tqdm=False)
    with LLM(str(models["llama"]), tensor_parallel_size=2, **options) as two:
        got = two.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(got, want)
    assert all(o.metrics.prefill_density < 1 and o.metrics.decode_density < 1 for o in got)


def test_worker_exception_is_a_clear_error_and_leaves_no_process(models, monkeypatch):
    monkeypatch.setenv(TEST_FAIL_ENV, "1:2")
    llm = LLM(str(models["llama"]), tensor_parallel_size=2, **COMMON, num_gpu_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"^tensor-parallel worker rank 1 failed: RuntimeError\('injected "
                                                  r"test failure at step 2 .+\) at executor.py:\d+ in _worker_main$"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert spawned_children() == []
    assert llm.block_manager.num_used_blocks == 0 and not llm.requests  # the failed batch was aborted
    with pytest.raises(TensorParallelError, match="tensor-parallel group is stopped: tensor-parallel worker rank 1"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()


DRIVER_SCRIPT = """
import os, sys, psutil
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", kvcache_block_size=16, num_gpu_blocks=16)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
print(" ".join(str(p.pid) for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
raise RuntimeError("the driver script fails with the engine still running")
"""


@pytest.mark.parametrize("how", ["exception", "kill"])
def test_driver_exit_leaves_no_process(models, how):
    """Interpreter exit by an uncaught exception (the engine is stopped at exit), or SIGKILL of the driver
    (each worker notices its driver is gone and exits)."""
    proc = subprocess.run([sys.executable, "-c", DRIVER_SCRIPT, str(models["llama"]), how], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == (-9 if how == "kill" else 1), proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def expected_shard(full: dict[str, torch.Tensor], name: str, hf: dict, rank: int) -> torch.Tensor:
    """Rank `rank` of 2's part of a one-rank parameter, from the config's numbers alone: KV heads and MLP columns
    halved, rank 0 taking the odd one; query heads with their KV heads; one KV head replicated."""
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or hf["hidden_size"] // heads
    inter, group = hf["intermediate_size"], heads // kv_heads
    halves = lambda n: (0, -(-n // 2)) if rank == 0 else (-(-n // 2), n // 2)  # noqa: E731  (first, count)
    if kv_heads >= 2:
        kv_first, kv_count = halves(kv_heads)
        q_first, q_count = kv_first * group, kv_count * group
    else:
        kv_first, kv_count, q_first, q_count = 0, 1, rank * heads // 2, heads // 2
    q, kv, (i_first, i_count) = heads * d, kv_heads * d, halves(inter)
    rows = lambda t, lo, n: t[lo : lo + n]  # noqa: E731
    t = full[name]
    if "qkv_proj" in name:
        return torch.cat([rows(t, q_first * d, q_count * d), rows(t, q + kv_first * d, kv_count * d),
                          rows(t, q + kv + kv_first * d, kv_count * d)])
    if "gate_up_proj" in name:
        return torch.cat([rows(t, i_first, i_count), rows(t, inter + i_first, i_count)])
    if "o_proj" in name:
        return t[:, q_first * d : (q_first + q_count) * d]
    if "down_proj" in name:
        return t[:, i_first : i_first + i_count]
    if "embed_tokens" in name or "lm_head" in name:
        per_rank = -(-hf["vocab_size"] // 2)
        return t[rank * per_rank : (rank + 1) * per_rank]
    return t


@pytest.mark.parametrize("random_weights", [False, True], ids=["safetensors", "random"])
@pytest.mark.parametrize("case", CASES)
def test_each_rank_loads_its_slice(models, case, random_weights):
    """Built without a process group (loading needs none): every parameter of ranks 0 and 1 is its slice
    of the one-rank model's, read from the files (or drawn as the one-rank random weights)."""
    hf = load_hf_config(str(models[case]))
    model_dir = None if random_weights else models[case]
    full = dict(build_model(hf, torch.float32, torch.device("cpu"), model_dir).named_parameters())
    for rank in (0, 1):
        part = build_model(hf, torch.float32, torch.device("cpu"), model_dir, tp=TensorParallel(rank, 2))
        for name, param in part.named_parameters():
            assert torch.equal(param, expected_shard(full, name, hf, rank)), (name, rank)


def test_one_rank_makes_no_collective_call(tiny_llama, monkeypatch):
    """tensor_parallel_size=1 is the plain path: no process group, no all-reduce, no parallel layer."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective with one rank")

    for name in ("all_reduce", "gather", "broadcast", "init_process_group"):
        monkeypatch.setattr(dist, name, refuse)
    llm = LLM(str(tiny_llama), **COMMON, num_gpu_blocks=64)
    assert llm.runner.tp_group is None
    assert {type(m).__name__ for m in llm.runner.model.modules()} >= {"Linear", "Embedding"}
    assert not any("Parallel" in type(m).__name__ for m in llm.runner.model.modules())
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)


def test_too_many_gpus_is_refused_before_anything_starts(tiny_llama, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 1 visible GPU"):
        LLM(str(tiny_llama), tensor_parallel_size=2, device="cuda")
    assert spawned_children() == []


@pytest.mark.parametrize("heads, kv_heads, inter, size, message", [
    (6, 3, 8, 4, "tensor_parallel_size=4 exceeds num_key_value_heads=3"),  # 3 KV heads cannot serve 4 ranks
    (5, 1, 8, 2, "divide num_attention_heads=5"),  # one replicated KV head: the query heads must split evenly
    (4, 2, 1, 2, "exceeds intermediate_size=1"),
])
def test_heads_that_cannot_be_shared_are_refused(heads, kv_heads, inter, size, message):
    hf = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
              max_position_embeddings=64)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", hf_config=hf, tensor_parallel_size=size)


@pytest.mark.parametrize("heads, kv_heads, inter, size", [(8, 2, 8, 4), (9, 3, 1536, 2), (32, 8, 14336, 3)])
def test_fewer_kv_heads_than_ranks_and_uneven_splits_are_accepted(heads, kv_heads, inter, size):
    """One KV head replicated over 2 ranks; SmolLM2's 3 KV heads over 2 ranks (2 + 1); 8 over 3 (3 + 3 + 2)."""
    hf = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
              max_position_embeddings=64)
    assert EngineConfig(model="m", hf_config=hf, tensor_parallel_size=size).tensor_parallel_size == size


def test_tp_flag_alias():
    import argparse

    from nanovllm.engine_args import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_options(parser.parse_args(["-tp", "2"])) == {"tensor_parallel_size": 2}
    assert engine_options(parser.parse_args(["--tensor-parallel-size", "4"])) == {"tensor_parallel_size": 4}
