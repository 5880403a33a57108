"""OpenAI request models for every route, validated with pydantic, and the mapping to SamplingParams.

Every refusal is an `APIError` whose `param` names the offending field, returned as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. Types are exact (a JSON true is not the number 1: the
models are strict) and values are checked by the same code as the offline API's (nanovllm/validation.py,
SamplingParams). Unknown fields are ignored with one warning per request; known fields that would change
the output and that this server cannot honour get a 400 naming them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanovllm import validation as v
from nanovllm.sampling_params import SamplingParams

log = logging.getLogger("nanovllm.server")

MAX_STOP_SEQUENCES = 4  # as in the OpenAI API
MAX_JSON_DEPTH = 64  # objects and arrays nested deeper are refused (a valid request needs 5)
MAX_LOGPROBS = 20  # logprobs, top_logprobs and prompt_logprobs, as vLLM's default max_logprobs
MAX_N = 128  # completions per prompt, as in the OpenAI API
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as in the OpenAI API
_ROLES = ("system", "user", "assistant", "developer", "tool")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- request models --------------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False


class TextPart(_Model):
    type: Literal["text"]
    text: str


class Message(_Model):
    role: Literal[_ROLES]
    content: str | list[TextPart] | None = None


class _Sampling(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    user: str | None = None
    # Sampling fields passed to SamplingParams by keyword once it has them (see sampling_params_from_request).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # a vLLM extension
    best_of: int | None = None
    suffix: str | None = None


class ChatTemplateOptions(_Model):
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class ChatRequest(_Sampling, ChatTemplateOptions):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(ChatTemplateOptions):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True  # for a prompt; messages are tokenized as /v1/chat/completions does


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


# Known fields (mostly vLLM extensions) that would change the output; refused unless absent or at this value.
REFUSED_UNLESS = {"suffix": None, "tools": None, "tool_choice": None, "use_beam_search": False,
                  "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": None, "guided_json": None,
                  "guided_regex": None, "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
                  "truncate_prompt_tokens": None, "logits_processors": None, "prompt_embeds": None,
                  "spaces_between_special_tokens": True, "documents": None,
                  "chat_template": None}  # a template from the client: only --chat-template is trusted
# Fields given to SamplingParams only where it has them; until then a value other than the default is refused.
ENGINE_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
                 "logit_bias": None, "include_stop_str_in_output": False, "skip_special_tokens": True}
# apply_chat_template's own parameters: chat_template_kwargs reach the template only, never these.
CHAT_TEMPLATE_RESERVED = ("conversation", "messages", "tokenize", "return_dict", "return_tensors", "chat_template",
                          "add_generation_prompt", "continue_final_message", "tools", "documents", "padding",
                          "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs")


# ---- parsing ---------------------------------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    prompts: list[str | list[int]] | None  # completions: one or more prompts
    messages: list[dict] | None  # chat
    params: SamplingParams  # max_tokens is a placeholder when max_tokens_given is False
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    model: str
    n: int = 1
    echo: bool = False
    logprobs: int | None = None  # completions: top-N per token; chat: top_logprobs when logprobs is true
    template: ChatTemplateOptions | None = None
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs was asked for (not only echo's)


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


def validate(model: type[BaseModel], body: dict, route: str) -> BaseModel:
    """body as `model`; a ValidationError becomes a 400 naming the field, unknown fields one warning."""
    not_unicode = [name for name in body if not _is_unicode(name)]  # never a field name; pydantic cannot take it
    try:
        request = model.model_validate({k: v for k, v in body.items() if k not in not_unicode})
    except ValidationError as e:
        raise _validation_error(e) from None
    unknown = [name for name in request.model_extra or {} if name not in REFUSED_UNLESS] + not_unicode
    if unknown:
        log.warning("%s: ignored unknown fields %s", route, ", ".join(ascii(name) for name in unknown))
    return request


def parse_completion(body: dict, served_names: tuple[str, ...]) -> ParsedRequest:
    req = validate(CompletionRequest, body, "/v1/completions")
    _refuse_unsupported(req)
    n = req.n or 1
    if req.best_of not in (None, n):
        raise APIError(400, f"best_of must be omitted or equal to n={n}, got {req.best_of}", "best_of")
    prompt_logprobs = req.prompt_logprobs
    if req.echo and prompt_logprobs is None:
        prompt_logprobs = req.logprobs  # echoed prompt tokens carry logprobs like the generated ones
    params = sampling_params_from_request(req, req.logprobs, prompt_logprobs)
    return ParsedRequest(_prompts(req.prompt), None, params, req.max_tokens is not None, bool(req.stream),
                         _include_usage(req), check_served(req.model, served_names), n, bool(req.echo), req.logprobs,
                         prompt_logprobs=req.prompt_logprobs is not None)


def parse_chat(body: dict, served_names: tuple[str, ...]) -> ParsedRequest:
    req = validate(ChatRequest, body, "/v1/chat/completions")
    _refuse_unsupported(req)
    if req.response_format not in (None, {"type": "text"}):
        raise APIError(400, "response_format is not supported (only {\"type\": \"text\"})", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    if req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    check_template_options(req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params_from_request(req, logprobs, None)
    return ParsedRequest(None, messages(req.messages), params, req.max_tokens is not None, bool(req.stream),
                         _include_usage(req), check_served(req.model, served_names), req.n or 1, False, logprobs,
                         ChatTemplateOptions(chat_template_kwargs=req.chat_template_kwargs,
                                             add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message))


def sampling_params_from_request(req: _Sampling, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams (n=1: the server runs n requests); max_tokens=None gets a placeholder the
    caller replaces once the prompt length is known. ENGINE_FIELDS go by keyword where SamplingParams has them."""
    if req.max_tokens is not None and req.max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
    placeholder = req.min_tokens if isinstance(req.min_tokens, int) and req.min_tokens > 1 else 1  # min_tokens <= it
    kwargs: dict[str, Any] = {"max_tokens": req.max_tokens if req.max_tokens is not None else placeholder,
                              "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
                              "stop": _stop(req.stop)}
    for name in ("temperature", "top_p", "min_p", "seed", "top_k", "ignore_eos", "stop_token_ids"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    supported = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, default in ENGINE_FIELDS.items():
        value = _engine_value(name, getattr(req, name))
        if name in supported and value is not None:
            kwargs[name] = value
        elif value not in (None, default, {}):
            raise APIError(400, f"{name} is not supported by this server yet (only {default!r})", name)
    try:
        return SamplingParams(**kwargs)
    except (v.InvalidType, v.InvalidValue) as e:  # the field first: "top_p must be in (0, 1], got 2.0"
        raise APIError(400, str(e), e.param.split("[", 1)[0]) from None


def _engine_value(name: str, value):
    if name != "logit_bias" or not value:
        return value
    bias = {}
    for key, b in value.items():
        if not key.isdigit() or int(key) > v.INT64_MAX:
            raise APIError(400, f"logit_bias keys must be token ids as strings, got {key!r}", "logit_bias")
        _checked(lambda n, x: v.number(n, x, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS), "logit_bias", b)
        bias[int(key)] = float(b)
    return bias


def check_template_options(req: ChatTemplateOptions) -> None:
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true; set "
                            "add_generation_prompt to false", "continue_final_message")
    reserved = sorted(set(req.chat_template_kwargs or {}) & set(CHAT_TEMPLATE_RESERVED))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")


def _refuse_unsupported(req: _Model) -> None:
    given = {**(req.model_extra or {}), **{k: getattr(req, k) for k in req.model_fields_set}}
    for name, allowed in REFUSED_UNLESS.items():
        value = given.get(name)
        harmless = value in (None, []) or (name == "tool_choice" and value in ("none", "auto"))
        if not harmless and not (value == allowed and isinstance(value, bool) == isinstance(allowed, bool)):
            raise APIError(400, f"{name} is not supported by this server", name)


def check_served(model: str | None, served_names: tuple[str, ...]) -> str:
    if model is not None and model not in served_names:
        raise model_not_found(model, served_names)
    return model or served_names[0]


def checked_text(name: str, value: str) -> str:
    return _checked(v.text, name, value)


def model_not_found(model: str, served_names: tuple[str, ...]) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {served_names[0]!r}",
                    "model", "model_not_found")


def _prompts(prompt) -> list[str | list[int]]:
    """One prompt (a string or token ids) or a batch of them, each checked."""
    if isinstance(prompt, str) or (prompt and v.is_int(prompt[0])):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must be a string, a list of token ids or a non-empty list of those", "prompt")
    for p in prompt:
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        _checked(v.text if isinstance(p, str) else v.token_ids, "prompt", p)
    return list(prompt)


def messages(items: list[Message]) -> list[dict]:
    """The conversation as the chat template takes it; content parts joined, an assistant's null content as ""."""
    out = []
    for i, m in enumerate(items):
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts (null only for "
                                "an assistant)", f"messages[{i}].content")
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        out.append({"role": m.role, "content": _checked(v.text, f"messages[{i}].content", content)})
    return out


def _checked(check, name: str, value):
    """check(name, value) with its InvalidType/InvalidValue as a 400 naming `name`."""
    try:
        return check(name, value)
    except (v.InvalidType, v.InvalidValue) as e:
        raise APIError(400, str(e), name) from None


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not all(stops):
        raise APIError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    _checked(v.strings, "stop", stops)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    return stops


def _include_usage(req: _Sampling) -> bool:
    if req.stream_options is None:
        return False
    if not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    return req.stream_options.include_usage


def _validation_error(e: ValidationError) -> APIError:
    """The first error as a 400: param is the top-level field (messages[i].field inside a conversation)."""
    error = e.errors(include_url=False)[0]
    loc = error["loc"]
    param = str(loc[0]) if loc else None
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        field = next((x for x in loc[2:] if isinstance(x, str) and x in Message.model_fields), None)
        param = f"messages[{loc[1]}]" + (f".{field}" if field else "")
    if error["type"] == "missing":
        return APIError(400, f"{param} is required", param)
    if param == "messages" and error["type"] in ("list_type", "too_short"):
        return APIError(400, "messages must be a non-empty list of {role, content} objects", param)
    message = error["msg"][:1].lower() + error["msg"][1:]
    return APIError(400, f"{param}: {message}, got {_describe(error.get('input'))}", param)


def _describe(value) -> str:
    text = repr(value)
    return _kind(value) if len(text) > 40 else f"{_kind(value)} {text}"


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _depth(value) -> int:
    """How deeply objects and arrays nest in value (iterative: a deep body must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if type(item) is dict else item
        if not _CONTAINERS.isdisjoint(map(type, children)):  # a prompt's thousands of ids pass in C
            stack.extend((c, depth + 1) for c in children if type(c) in _CONTAINERS)
    return deepest


_CONTAINERS = frozenset((dict, list))  # what json.loads makes of objects and arrays


def _kind(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _encodable(text: str) -> str:
    """text with lone surrogates (from a client's JSON) spelled out, so the error body encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
