"""Strict validation of the offline API: SamplingParams and prompt types, concurrent generate(), a failed step."""
from __future__ import annotations

import math
import threading

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.llm_engine import StepFailed
from nanovllm.validation import INT64_MAX

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=32, max_model_len=256, device="cpu")


def assert_idle(llm) -> None:
    assert not llm.has_unfinished_requests() and not llm.requests
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_invariants([])


@pytest.mark.parametrize("kwargs, error, field", [
    ({"temperature": math.nan}, ValueError, "temperature"),
    ({"temperature": math.inf}, ValueError, "temperature"),
    ({"temperature": 10**400}, ValueError, "temperature"),
    ({"temperature": "0.5"}, TypeError, "temperature"),
    ({"temperature": True}, TypeError, "temperature"),
    ({"top_p": True}, TypeError, "top_p"),
    ({"top_p": math.nan}, ValueError, "top_p"),
    ({"min_p": -math.inf}, ValueError, "min_p"),
    ({"top_k": 2**63}, ValueError, "top_k"),
    ({"top_k": 1.0}, TypeError, "top_k"),
    ({"seed": 2**64}, ValueError, "seed"),
    ({"seed": 2**63}, ValueError, "seed"),
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": -(2**63) - 1}, ValueError, "seed"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"seed": False}, TypeError, "seed"),
    ({"max_tokens": 2**63}, ValueError, "max_tokens"),
    ({"max_tokens": True}, TypeError, "max_tokens"),
    ({"stop": {"a": 1}}, TypeError, "stop"),
    ({"stop": {"a"}}, TypeError, "stop"),
    ({"stop": b"a"}, TypeError, "stop"),
    ({"stop": [""]}, ValueError, r"stop\[0\]"),
    ({"stop": ["x\ud800"]}, ValueError, r"stop\[0\]"),
    ({"stop_token_ids": [1, True]}, TypeError, r"stop_token_ids\[1\]"),
    ({"stop_token_ids": [2**63]}, ValueError, r"stop_token_ids\[0\]"),
    ({"stop_token_ids": {1: 2}}, TypeError, "stop_token_ids"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos"),
    ({"logprobs": -1}, ValueError, "logprobs"),
    ({"prompt_logprobs": 1.0}, TypeError, "prompt_logprobs"),
])
def test_sampling_params_refuse_bad_types_and_values(kwargs, error, field):
    with pytest.raises(error, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges():
    edge = SamplingParams(temperature=2**63, top_p=1, min_p=0, seed=2**63 - 1, max_tokens=INT64_MAX, top_k=INT64_MAX,
                          stop=("a", "b"), stop_token_ids=(0, INT64_MAX))
    assert edge.temperature == float(2**63) and isinstance(edge.top_p, float) and edge.stop == ["a", "b"]
    assert edge.stop_token_ids == [0, INT64_MAX]
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=0.99e-5).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_fields_changed_after_construction_are_checked_at_admission(llm):
    params = SamplingParams(max_tokens=4)
    params.seed = 2**64
    with pytest.raises(ValueError, match="^seed "):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize("prompts, error, message", [
    ({"a": 1}, TypeError, "prompts must be a str or a list of int token ids, or a list/tuple of those; got dict"),
    (b"abc", TypeError, "got bytes"),
    ({"x", "y"}, TypeError, "got set"),
    ([[1, 2], b"ab"], TypeError, r"prompts\[1\] must be a str or a list of int token ids, got bytes"),
    ([1, 2, True], TypeError, "got a list holding bool"),
    ([[1, 2.0]], TypeError, "got a list holding float"),
    (["x\ud800y"], ValueError, "lone surrogate"),
    ([[1, -5]], ValueError, r"prompts\[0\]\[1\] must be an integer in \[0, 2\*\*63 - 1\]"),
])
def test_generate_refuses_prompts_of_other_types(llm, prompts, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_token_id_lists_are_checked_alike_on_the_fast_and_the_per_item_path():
    """Lists of plain ints take a C-speed check; an int subclass takes the per-item one and is accepted, and
    out-of-range or non-int items are refused there with the item named."""
    import enum

    from nanovllm import validation

    class Token(enum.IntEnum):
        A = 3

    assert validation.prompt(list(range(5000))) == list(range(5000))
    assert validation.prompt((Token.A, 4)) == [Token.A, 4]
    assert validation.prompts([5, 6]) == [[5, 6]] and validation.prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert validation.token_ids("ids", []) == []
    with pytest.raises(ValueError, match=r"ids\[2\] must be an integer in \[0, 2\*\*63 - 1\], got 9223372036854775808"):
        validation.token_ids("ids", [1, 2, INT64_MAX + 1])
    with pytest.raises(TypeError, match=r"ids\[1\] must be an integer, got bool"):
        validation.token_ids("ids", [1, False])


def test_generate_refuses_params_of_other_types(llm):
    with pytest.raises(TypeError, match="sampling_params must be"):
        llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be"):
        llm.generate([[1, 2]], [{"temperature": 0}], use_tqdm=False)


def test_logprobs_beyond_the_vocab_are_refused(llm):
    with pytest.raises(ValueError, match="logprobs=257 exceeds the model's vocab_size=256"):
        llm.generate([[1, 2]], SamplingParams(logprobs=257), use_tqdm=False)
    assert_idle(llm)


def test_tiny_temperature_is_greedy(llm):
    greedy = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
    tiny = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
    mixed = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True),
                                               SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)],
                         use_tqdm=False)
    assert mixed[0].token_ids == greedy[0].token_ids


def test_generate_from_several_threads_at_once(llm):
    prompts = [[[i, i + 1, i + 2]] * 3 for i in range(1, 5)]
    expected = [llm.generate(p, GREEDY, use_tqdm=False) for p in prompts]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = llm.generate(prompts[i], GREEDY, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, want in enumerate(expected):
        assert [o.token_ids for o in results[i]] == [o.token_ids for o in want]
    assert_idle(llm)


def test_a_failed_step_aborts_its_batch_and_the_engine_goes_on(llm, monkeypatch):
    want = llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0].token_ids
    run = llm.runner.run
    calls = {"n": 0}

    def fail_on_the_third_step(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return run(*args)

    monkeypatch.setattr(llm.runner, "run", fail_on_the_third_step)
    first = llm.add_request([1, 2, 3], GREEDY)
    second = llm.add_request([4, 5, 6], GREEDY)
    llm.step()
    llm.step()
    with pytest.raises(StepFailed, match="injected") as failure:
        llm.step()
    assert sorted(failure.value.request_ids) == sorted([first, second])
    assert isinstance(failure.value.__cause__, RuntimeError)
    assert_idle(llm)
    assert llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0].token_ids == want
