"""The server's request models without a server: field errors, unknown and unsupported fields, null as omitted,
and the mapping to SamplingParams (engine fields passed by keyword)."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("pydantic")

from nanovllm.server import protocol as p

NAMES = ("smollm2",)


def refused(body: dict, chat: bool = False) -> p.APIError:
    with pytest.raises(p.APIError) as e:
        (p.parse_chat if chat else p.parse_completion)(body, NAMES)
    return e.value


@pytest.mark.parametrize("name, value", [("presence_penalty", 0.5), ("frequency_penalty", -1.0),
                                         ("repetition_penalty", 1.2), ("min_tokens", 3), ("logit_bias", {"5": 1.0}),
                                         ("include_stop_str_in_output", True), ("skip_special_tokens", False)])
def test_engine_fields_reach_sampling_params(name, value):
    """Each of the engine's sampling fields is passed to SamplingParams by name (logit_bias keys as ints);
    without max_tokens, the placeholder leaves room for min_tokens (the real limit is set per prompt)."""
    params = p.parse_completion({"prompt": "hi", name: value}, NAMES).params
    assert getattr(params, name) == ({5: 1.0} if name == "logit_bias" else value)
    assert params.max_tokens == (3 if name == "min_tokens" else 1)
    assert p.parse_completion({"prompt": "hi", name: p.ENGINE_FIELDS[name]}, NAMES).params.max_tokens == 1


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias", "valid number"),
    ({"prompt": "hi", "n": 129}, "n", "less than or equal to 128"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
    ({"prompt": "hi", "min_tokens": "3"}, "min_tokens", "valid integer"),
    ({"prompt": "hi", "guided_json": {"type": "object"}}, "guided_json", "not supported"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search", "not supported"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"prompt": [[1, 2], []]}, "prompt", "must not be empty"),
    ({}, "prompt", "prompt is required"),
])
def test_bad_completion_fields_name_the_field_and_the_limit(body, param, message):
    error = refused(body)
    assert error.status == 400 and error.param == param and message in error.message, error.message


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, 5]}, "messages[1]"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenizer_kwargs": {}}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1}, "add_generation_prompt"),
])
def test_bad_chat_fields_name_the_field(body, param):
    assert refused(body, chat=True).param == param


def test_null_means_omitted_and_unknown_fields_warn_once(caplog):
    with caplog.at_level(logging.WARNING, "nanovllm.server"):
        parsed = p.parse_chat({"messages": [{"role": "assistant", "content": None}], "stream": None, "n": None,
                               "logprobs": None, "frequency_penalty": None, "foo": 1, "bar": None}, NAMES)
    assert (parsed.stream, parsed.n, parsed.logprobs, parsed.messages) == (False, 1, None,
                                                                         [{"role": "assistant", "content": ""}])
    assert [r.getMessage() for r in caplog.records] == ["/v1/chat/completions: ignored unknown fields 'foo', 'bar'"]
    chat = p.parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "tool_choice": "auto",
                         "tools": []}, NAMES)
    assert chat.logprobs == 0 and chat.params.logprobs == 0
    echo = p.parse_completion({"prompt": [[1, 2], [3]], "echo": True, "logprobs": 2, "n": 2, "best_of": 2}, NAMES)
    assert echo.prompts == [[1, 2], [3]] and echo.params.prompt_logprobs == 2 and not echo.prompt_logprobs


def test_json_depth_limit_holds_wherever_the_nesting_sits():
    """64 levels pass, 65 are refused, also when the deep part follows thousands of token ids in one array or
    sits in an object's last field."""
    def nested(levels: int) -> str:  # `levels` arrays, one inside the other
        return "[" * levels + "]" * levels

    ids = ",".join(["7"] * 5000)
    for levels, ok in ((63, True), (64, False)):  # the body object itself is one level
        for raw in (f'{{"prompt": [{ids}, {nested(levels - 1)}]}}', f'{{"a": 1, "b": {{"c": {nested(levels - 1)}}}}}'):
            if ok:
                p.parse_json(raw.encode())
            else:
                with pytest.raises(p.APIError, match=f"nests deeper than {p.MAX_JSON_DEPTH} levels"):
                    p.parse_json(raw.encode())
