"""OpenAI request validation and response shapes for /v1/completions and /v1/chat/completions.

Every refusal is an `APIError` whose `param` names the offending field, returned as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. Types are exact (a JSON true is not the number 1) and
values are checked by the same code as the offline API's (nanovllm/validation.py, SamplingParams).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nanovllm import validation as v
from nanovllm.sampling_params import SamplingParams

MAX_STOP_SEQUENCES = 4  # as in the OpenAI API
MAX_JSON_DEPTH = 64  # objects and arrays nested deeper are refused (a valid request needs 4)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    model: str


_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
           "top_k", "min_p", "ignore_eos", "stop_token_ids"}  # the last four are vLLM extensions
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "response_format", "parallel_tool_calls"}
_ROLES = ("system", "user", "assistant", "developer", "tool")


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from None
    except ValueError as e:  # JSONDecodeError, not UTF-8, NaN/Infinity, an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}", None, "invalid_json")
    if _depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _depth(value) -> int:
    """How deeply objects and arrays nest in value (iterative: a deep body must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def parse_completion(body: dict, served_names: tuple[str, ...]) -> ParsedRequest:
    _check_fields(body, COMPLETION_FIELDS)
    _unsupported(body, "echo", (None, False), "echo is not supported")
    _unsupported(body, "best_of", (None, 1), "best_of must be 1")
    _unsupported(body, "suffix", (None,), "suffix is not supported")
    return _parsed(body, served_names, prompt=_prompt(body.get("prompt")), messages=None)


def parse_chat(body: dict, served_names: tuple[str, ...]) -> ParsedRequest:
    _check_fields(body, CHAT_FIELDS)
    _unsupported(body, "top_logprobs", (None, 0), "top_logprobs is not supported")
    for name in ("tools", "tool_choice", "response_format", "parallel_tool_calls"):
        _unsupported(body, name, (None,), f"{name} is not supported")
    if body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return _parsed(body, served_names, prompt=None, messages=_messages(body.get("messages")))


def _parsed(body: dict, served_names: tuple[str, ...], prompt, messages) -> ParsedRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {_kind(model)}", "model")
    if model is not None and model not in served_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served_names[0]!r}",
                       "model", "model_not_found")
    _unsupported(body, "n", (None, 1), "n must be 1: one completion per request is supported")
    _unsupported(body, "logprobs", (None, False), "logprobs are not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value not in (None, 0):
            raise APIError(400, f"{name} is not supported (only 0)", name)
    if body.get("logit_bias") not in (None, {}):
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, f"user must be a string, got {_kind(body['user'])}", "user")
    stream = _bool(body, "stream", False)
    max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    params = _sampling_params(body, max_tokens)
    return ParsedRequest(prompt, messages, params, max_tokens is not None, stream, _include_usage(body, stream),
                         model or served_names[0])


def _sampling_params(body: dict, max_tokens: int | None) -> SamplingParams:
    """The request's SamplingParams; max_tokens=None gets a placeholder the caller replaces once the
    prompt length is known (the room left in the context window, for completions at most 16)."""
    kwargs: dict[str, Any] = {"max_tokens": max_tokens or 1}
    for name in ("temperature", "top_p", "min_p", "seed", "top_k", "ignore_eos", "stop_token_ids"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    kwargs["stop"] = _stop(body.get("stop"))
    try:
        return SamplingParams(**kwargs)
    except (v.InvalidType, v.InvalidValue) as e:  # the field first: "top_p must be in (0, 1], got 2.0"
        raise APIError(400, str(e), e.param.split("[", 1)[0]) from None


def _prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        return _checked(v.text, "prompt", prompt)
    if isinstance(prompt, list) and prompt and all(v.is_int(t) for t in prompt):
        return _checked(v.token_ids, "prompt", prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "batched prompts are not supported: send one prompt per request", "prompt")
    if prompt is None:
        raise APIError(400, "prompt is required", "prompt")
    raise APIError(400, f"prompt must be a string or a non-empty list of token ids, got {_kind(prompt)}", "prompt")


def _checked(check, name: str, value):
    """check(name, value) with its InvalidType/InvalidValue as a 400 naming `name`."""
    try:
        return check(name, value)
    except (v.InvalidType, v.InvalidValue) as e:
        raise APIError(400, str(e), name) from None


def _messages(messages) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object, got {_kind(m)}", f"messages[{i}]")
        if m.get("role") not in _ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {list(_ROLES)}, got {m.get('role')!r}",
                           f"messages[{i}].role")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return out


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return _checked(v.text, f"messages[{i}].content", content)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return _checked(v.text, f"messages[{i}].content", "".join(p["text"] for p in content))
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    _checked(v.strings, "stop", stops)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    return stops


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, "stream_options must be an object like {\"include_usage\": true}", "stream_options")
    return options.get("include_usage", False)


def _check_fields(body: dict, known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise APIError(400, f"unrecognized request argument supplied: {name}", name)


def _unsupported(body: dict, name: str, allowed: tuple, message: str) -> None:
    """Refuse body[name] unless it is one of allowed, of the same type (a JSON true is not 1)."""
    value = body.get(name)
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise APIError(400, message, name)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    return None if value is None else _checked(v.integer, name, value)


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    return None if value is None else _checked(v.number, name, value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean, got {_kind(value)}", name)
    return value


def _kind(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _encodable(text: str) -> str:
    """text with lone surrogates (from a client's JSON) spelled out, so the error body encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---- responses ---------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, usage_: dict, created: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": usage_}


def chat_body(rid: str, model: str, text: str, finish: str | None, usage_: dict, created: int) -> dict:
    message = {"role": "assistant", "content": text}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}], "usage": usage_}


def chunk(rid: str, model: str, created: int, chat: bool, delta: str | None, finish: str | None,
          role: bool = False) -> dict:
    if chat:
        d: dict = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_}


def now() -> int:
    return int(time.time())
