"""Request preparation off the engine loop: parse, validate, tokenize.

`prepare`: JSON parsing and validation (protocol.py), the chat template or the tokenizer, and every check that
needs the prompt's length. A small body's on the event loop itself, a larger one's on a small thread pool (HF fast
tokenizers release the GIL while they encode), so a huge prompt delays only its own request; the engine loop
receives token ids. After a large body, freed heap memory is handed back to the OS (glibc's malloc_trim), so one
big request does not leave gigabytes behind.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.server import protocol as p

PREPROCESS_THREADS = 4
DEFAULT_COMPLETION_MAX_TOKENS = 16  # as in the OpenAI API, when the room left in the context allows
TRIM_AFTER_BYTES = 1 << 20  # bodies at least this large are followed by malloc_trim
# Bodies up to this size are prepared on the event loop (a prompt of 256 token ids in ~0.1 ms; 4 KiB of text through
# SmolLM2's tokenizer or its chat template ~1.4 ms on a 2-core VM): through the pool, a burst of requests reached
# the engine only after the loop had taken in a few hundred of them (the first of 500 at 68-169 ms, inline at 2-5 ms;
# docs/BENCHMARKS.md), the engine idle meanwhile.
INLINE_BODY_BYTES = 4096


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    params: SamplingParams  # max_tokens filled in for this prompt's length
    text: str  # the prompt as text, for echo ("" unless echo was asked)


@dataclass
class PreparedRequest:
    parsed: p.ParsedRequest
    prompts: list[PreparedPrompt]
    prompt_field: str  # the body field an error about the prompt names: "prompt" or "messages"


class Preprocessor:
    def __init__(self, llm: LLM, served_names: tuple[str, ...], chat_template: str | None = None):
        self.llm = llm
        self.served_names = served_names
        self.chat_template = chat_template
        self.pool = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="nanovllm-preprocess")
        self._malloc_trim = _malloc_trim()

    async def prepare(self, raw: bytes, chat: bool) -> PreparedRequest:
        """Raises APIError for anything the request cannot be served with."""
        return await self.run(self._prepare, raw, chat)

    async def run(self, fn: Callable[[bytes, Any], Any], raw: bytes, *args) -> Any:
        """fn(raw, *args): a small body's on the event loop, a larger one's on the pool (then malloc_trim after a
        large body)."""
        if len(raw) <= INLINE_BODY_BYTES:
            return fn(raw, *args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._run_and_trim, fn, raw, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _run_and_trim(self, fn, raw: bytes, *args):
        try:
            return fn(raw, *args)
        finally:
            if len(raw) >= TRIM_AFTER_BYTES and self._malloc_trim is not None:
                self._malloc_trim(0)

    def _prepare(self, raw: bytes, chat: bool) -> PreparedRequest:
        body = p.parse_json(raw)
        if chat:
            parsed = p.parse_chat(body, self.served_names)
            prompts = [(self.chat_prompt(parsed.messages, parsed.template), "")]
        else:
            parsed = p.parse_completion(body, self.served_names)
            prompts = [(self._tokenize(q), self._echo_text(q) if parsed.echo else "") for q in parsed.prompts]
        field = "messages" if chat else "prompt"
        return PreparedRequest(parsed, [self._prompt(ids, text, parsed, chat, field) for ids, text in prompts], field)

    def _prompt(self, token_ids: list[int], text: str, parsed: p.ParsedRequest, chat: bool,
                field: str) -> PreparedPrompt:
        max_tokens = self._max_tokens(len(token_ids), parsed, chat)
        if parsed.params.min_tokens > max_tokens:
            raise p.APIError(400, f"min_tokens={parsed.params.min_tokens} is more than the {max_tokens} tokens this "
                                  f"request may generate", "min_tokens")
        params = dataclasses.replace(parsed.params, max_tokens=max_tokens)
        self._check(token_ids, params, parsed.max_tokens_given, field)
        return PreparedPrompt(token_ids, params, text)

    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str) and self.llm.tokenizer is not None:
            return self.llm.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        try:
            return self.llm.tokenize(prompt)
        except (TypeError, ValueError) as e:  # no tokenizer for a text prompt
            raise p.APIError(400, str(e), "prompt") from None

    def _echo_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.llm.tokenizer.decode(prompt) if self.llm.tokenizer is not None else ""

    def chat_prompt(self, messages: list[dict], options: p.ChatTemplateOptions) -> list[int]:
        """The conversation through the chat template (--chat-template, else the model's), as token ids."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None or not (self.chat_template or getattr(tokenizer, "chat_template", None)):
            raise p.APIError(400, "this model has no chat template; use /v1/completions or start the server with "
                                  "--chat-template", "messages")
        try:
            ids = tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=True,
                                                add_generation_prompt=options.add_generation_prompt,
                                                continue_final_message=options.continue_final_message,
                                                **(options.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - the template itself rejects some conversations
            raise p.APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def tokenize(self, raw: bytes) -> dict:
        """/tokenize: a prompt or a conversation -> {count, max_model_len, tokens}."""
        req = p.validate(p.TokenizeRequest, p.parse_json(raw), "/tokenize")
        p.check_served(req.model, self.served_names)
        if (req.prompt is None) == (req.messages is None):
            raise p.APIError(400, "send exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            p.check_template_options(req)
            tokens = self.chat_prompt(p.messages(req.messages), req)
        else:
            text = p.checked_text("prompt", req.prompt)
            tokens = self._tokenize(text, req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.llm.config.max_model_len, "tokens": tokens}

    def detokenize(self, raw: bytes) -> dict:
        """/detokenize: {tokens} -> {prompt}."""
        req = p.validate(p.DetokenizeRequest, p.parse_json(raw), "/detokenize")
        p.check_served(req.model, self.served_names)
        if self.llm.tokenizer is None:
            raise p.APIError(400, "this model has no tokenizer", "tokens")
        vocab = self.llm.config.hf_config["vocab_size"]
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise p.APIError(400, f"tokens[{bad}] must be a token id in [0, {vocab}), got {req.tokens[bad]}", "tokens")
        return {"prompt": self.llm.tokenizer.decode(req.tokens)}

    def _check(self, token_ids: list[int], params: SamplingParams, max_tokens_given: bool, field: str) -> None:
        """The engine's own admission checks, then (as vLLM's server) no max_tokens past the context."""
        try:
            self.llm.check_request(token_ids, params)
        except (TypeError, ValueError) as e:
            raise refusal(e, field) from None
        limit, n = self.llm.config.max_model_len, len(token_ids)
        if max_tokens_given and n + params.max_tokens > limit:
            raise p.APIError(400, f"max_tokens={params.max_tokens} is too large: the prompt has {n} tokens and "
                             f"this model's context is max_model_len={limit} tokens, so at most {limit - n} can be "
                             "generated", "max_tokens", "context_length_exceeded")

    def _max_tokens(self, num_prompt_tokens: int, parsed: p.ParsedRequest, chat: bool) -> int:
        if parsed.max_tokens_given:
            return parsed.params.max_tokens
        room = max(1, self.llm.config.max_model_len - num_prompt_tokens)  # a prompt without room is refused next
        return room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)


def refusal(e: Exception, field: str) -> p.APIError:
    """An engine refusal (ValueError: max_model_len, KV pool size, vocab) as a 400 naming the limit."""
    message = str(e)
    code = "context_length_exceeded" if "max_model_len" in message or "KV blocks" in message else None
    return p.APIError(400, message, field, code)


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
