"""Options, bad inputs and sampling behaviour of the public API."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=32, max_model_len=256, device="cpu")


def served_correctly(llm) -> bool:
    prompt = list(range(1, 40))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    fresh = LLM(llm.config.model, kvcache_block_size=16, num_gpu_blocks=32, device="cpu")
    ref = fresh.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    return out.token_ids == ref.token_ids and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_unknown_option_names_it(tiny_llama):
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(str(tiny_llama), max_num_seq=4)


@pytest.mark.parametrize("option, value, message", [
    ("max_num_seqs", 0, "max_num_seqs"),
    ("kvcache_block_size", 24, "multiple of 16"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("dtype", "int8", "dtype"),
    ("device", "tpu", "device"),
    ("max_model_len", 10**6, "max_position_embeddings=512"),
    ("tensor_parallel_size", 3, "tensor_parallel_size=3 exceeds num_key_value_heads=2"),
    ("tensor_parallel_size", 0, "tensor_parallel_size"),
])
def test_invalid_option_values(tiny_llama, option, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), **{option: value})


def test_config_is_frozen(llm):
    with pytest.raises(Exception):
        llm.config.max_num_seqs = 3


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": -1}))
    with pytest.raises(ValueError, match="hidden_size"):
        EngineConfig.from_options(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 1,
                                                      "vocab_size": 8, "max_position_embeddings": 8}))
    with pytest.raises(ValueError, match="unsupported architectures"):
        LLM(str(tmp_path), num_gpu_blocks=1)


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    (list(range(256)), SamplingParams(), "max_model_len=256"),
    ([1, 2, 300], SamplingParams(), "vocab_size"),
])
def test_bad_requests_are_refused_and_engine_keeps_serving(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    assert not llm.has_unfinished_requests()  # the good prompt of the batch was not left behind
    assert served_correctly(llm)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n must be an integer in \\[1,"),
    ({"n": 2, "best_of": 3}, "best_of must be None or equal to n=2"),
    ({"n": 3, "best_of": 2}, "best_of must be an integer in \\[3,"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in \\[-2, 2\\]"),
    ({"min_tokens": 17}, "min_tokens must be an integer in \\[0, 16\\]"),
    ({"logit_bias": {5: 100.5}}, "logit_bias\\[5\\] must be in \\[-100, 100\\]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias\\[-1\\] must be an integer in \\[0,"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be integer token ids, got str"),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias must be a dict"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a boolean"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be a boolean"),
    ({"n": 2.0}, "n must be an integer"),
])
def test_bad_sampling_param_types(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


def test_request_larger_than_pool_is_refused(tiny_llama):
    small = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=4, device="cpu")  # 64 tokens of KV
    with pytest.raises(ValueError, match="needs 5 KV blocks .* pool has 4"):
        small.generate([list(range(60))], SamplingParams(max_tokens=10), use_tqdm=False)
    out = small.generate([list(range(60))], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 5


def test_near_the_limit_stops_with_length(tiny_llama):
    engine = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=16, max_model_len=256, device="cpu")
    out = engine.generate([list(range(250))], SamplingParams(max_tokens=128, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 256


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate([[9, 9], [1, 2, 3], [4]], [other, sp, other], use_tqdm=False)[1].token_ids
    assert alone == batched
    different = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                             use_tqdm=False)[0].token_ids
    assert different != alone


def test_stop_token_ids_and_logprobs(llm):
    greedy = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    stop_at = greedy[3]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   stop_token_ids=[stop_at], logprobs=2), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(stop_at) + 1]
    for step, token in zip(out.outputs[0].logprobs, out.token_ids):
        assert token in step and len(step) <= 3 and max(step.values()) == step[token]  # greedy = top-1


def test_logprobs_are_normalised(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=1, logprobs=256), use_tqdm=False)[0]
    total = torch.tensor(list(out.outputs[0].logprobs[0].values())).exp().sum()
    assert abs(float(total) - 1.0) < 1e-4


def test_checkpoint_missing_a_projection_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensors, e.g. \\['model.layers.1.self_attn.qkv_proj.weight'\\]"):
        LLM(str(path), num_gpu_blocks=4, device="cpu")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stats_count_the_steps_by_the_planners_kind(tiny_llama, async_scheduling):
    """stats().steps: decode steps (every row samples its one new token: the step planner's decode plan, the one CUDA
    graphs run), mixed and prefill-only steps, as the planner's plans show them; chunked prompts arriving while
    others decode make all three."""
    from nanovllm.engine.step_plan import STEP_KINDS

    llm = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=32, device="cpu",
              async_scheduling=async_scheduling)
    planned = {kind: 0 for kind in STEP_KINDS}
    plan = llm.runner.planner.plan

    def recording(scheduled, offloads, launched=False):
        step = plan(scheduled, offloads, launched)
        ends = list(itertools.accumulate(step.query_lens))
        decode_rows = sum(n == 1 and end - 1 in step.sample_rows for n, end in zip(step.query_lens, ends))
        kind = "decode" if step.prefill_ends is None else "prefill" if decode_rows == 0 else "mixed"
        planned[kind] += 1
        return step

    llm.runner.planner.plan = recording
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.add_request(list(range(3, 43)), params)  # 40 tokens: two chunks
    for step in range(12):
        if step == 3:  # arrives while the first decodes: its chunks share steps with decode rows
            llm.add_request(list(range(5, 60)), params)
        llm.step()
    counted = dict(zip(STEP_KINDS, llm.stats().steps))
    assert counted == planned and all(counted.values()), counted
    # the host's time in each kind's forward passes (the whole pass on the CPU), within the steps' time
    forward = llm.stats().forward_seconds
    assert all(seconds > 0 for seconds in forward) and sum(forward) < llm.stats().step_seconds, forward


def test_forward_seconds_count_steps_not_the_start_up(tiny_llama):
    """stats().forward_seconds starts at zero after the engine's start-up and grows only in the kinds of steps that
    run: a prompt of two tokens is prefilled in a prefill step and then decodes."""
    llm = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=16, device="cpu")
    assert llm.stats().forward_seconds == (0.0, 0.0, 0.0)
    llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    assert stats.steps == (2, 0, 1) and stats.forward_seconds[0] > 0 and stats.forward_seconds[2] > 0
    assert stats.forward_seconds[1] == 0.0
