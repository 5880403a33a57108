"""Request preparation off the event loop and the engine thread: parse, validate, tokenize.

A small thread pool runs `prepare`: JSON parsing and validation (protocol.py), the chat template or the
tokenizer (HF fast tokenizers release the GIL while they encode), and every check that needs the prompt's
length. A huge prompt thus delays only its own request; the engine thread receives token ids. After a
large body, freed heap memory is handed back to the OS (glibc's malloc_trim), so one big request does not
leave gigabytes behind.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nanovllm.llm import LLM
from nanovllm.server import protocol as p

PREPROCESS_THREADS = 4
DEFAULT_COMPLETION_MAX_TOKENS = 16  # as in the OpenAI API, when the room left in the context allows
TRIM_AFTER_BYTES = 1 << 20  # bodies at least this large are followed by malloc_trim


@dataclass
class PreparedRequest:
    parsed: p.ParsedRequest
    token_ids: list[int]
    prompt_field: str  # the body field an error about the prompt names: "prompt" or "messages"


class Preprocessor:
    def __init__(self, llm: LLM, served_names: tuple[str, ...]):
        self.llm = llm
        self.served_names = served_names
        self.pool = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="nanovllm-preprocess")
        self._malloc_trim = _malloc_trim()

    async def prepare(self, raw: bytes, chat: bool) -> PreparedRequest:
        """Raises APIError for anything the request cannot be served with."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._prepare_and_trim, raw, chat)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _prepare_and_trim(self, raw: bytes, chat: bool) -> PreparedRequest:
        try:
            return self._prepare(raw, chat)
        finally:
            if len(raw) >= TRIM_AFTER_BYTES and self._malloc_trim is not None:
                self._malloc_trim(0)

    def _prepare(self, raw: bytes, chat: bool) -> PreparedRequest:
        body = p.parse_json(raw)
        if chat:
            parsed, field = p.parse_chat(body, self.served_names), "messages"
            token_ids = self._chat_prompt(parsed.messages)
        else:
            parsed, field = p.parse_completion(body, self.served_names), "prompt"
            token_ids = self._tokenize(parsed.prompt)
        parsed.params = dataclasses.replace(parsed.params, max_tokens=self._max_tokens(len(token_ids), parsed, chat))
        self._check(token_ids, parsed, field)
        return PreparedRequest(parsed, token_ids, field)

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.llm.tokenize(prompt)
        except (TypeError, ValueError) as e:  # no tokenizer for a text prompt, or the tokenizer refused it
            raise p.APIError(400, str(e), "prompt") from None

    def _chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if self.llm.tokenizer is None or not getattr(self.llm.tokenizer, "chat_template", None):
            raise p.APIError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            return self.llm.chat_prompt(messages)  # the same template call as LLM.chat
        except Exception as e:  # noqa: BLE001 - the template itself rejects some conversations
            raise p.APIError(400, f"the chat template rejected the messages: {e}", "messages") from None

    def _check(self, token_ids: list[int], parsed: p.ParsedRequest, field: str) -> None:
        """The engine's own admission checks, then (as vLLM's server) no max_tokens past the context."""
        try:
            self.llm.check_request(token_ids, parsed.params)
        except (TypeError, ValueError) as e:
            raise refusal(e, field) from None
        limit, n = self.llm.config.max_model_len, len(token_ids)
        if parsed.max_tokens_given and n + parsed.params.max_tokens > limit:
            raise p.APIError(400, f"max_tokens={parsed.params.max_tokens} is too large: the prompt has {n} tokens and "
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
