"""OpenAI response shapes: completion and chat bodies, SSE chunks, usage, logprobs in OpenAI's two layouts
(completions: parallel lists; chat: one object per token), and `Choices`, which builds a request's choices from
its engine outputs."""
from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence

from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.server.preprocess import PreparedRequest

Entry = dict[int, float] | None  # a position's {token id: logprob}: the token first, then the top-N
TokenText = Callable[[int], str]


class TokenTexts:
    """Token id -> that token's text alone, as logprobs show it (cached: one decode per vocabulary entry)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---- logprobs --------------------------------------------------------------------------------------------------
def completion_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], text: TokenText,
                        offset: int = 0) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; a position without an entry (the first prompt
    token) has None. top_logprobs holds the token itself and the top-N, keyed by text (the larger logprob
    where two tokens share a text)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        token = text(token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        out["token_logprobs"].append(None if entry is None else entry[token_id])
        out["top_logprobs"].append(None if entry is None else _by_text(entry, text))
    return out


def _by_text(entry: dict[int, float], text: TokenText) -> dict[str, float]:
    top: dict[str, float] = {}
    for token_id, logprob in entry.items():
        key = text(token_id)
        top[key] = max(top.get(key, -math.inf), logprob)
    return top


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], text: TokenText, top_n: int) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] (the top_n most likely)}]}"""
    content = []
    for token_id, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda item: -item[1])[:top_n]
        content.append({**_chat_token(text(token_id), entry[token_id]),
                        "top_logprobs": [_chat_token(text(t), lp) for t, lp in top]})
    return {"content": content}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def prompt_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], text: TokenText) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, decoded_token}}."""
    return [None if entry is None else {str(t): {"logprob": lp, "decoded_token": text(t)} for t, lp in entry.items()}
            for _, entry in zip(token_ids, entries)]


# ---- bodies and chunks -----------------------------------------------------------------------------------------
def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None,
                      prompt_logprobs_: list | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if prompt_logprobs_ is not None:
        choice["prompt_logprobs"] = prompt_logprobs_
    return choice


def chat_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}


def body(rid: str, model: str, chat: bool, choices: list[dict], usage_: dict, created: int) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_}


def chunk(rid: str, model: str, created: int, chat: bool, index: int, delta: str | None, finish: str | None,
          logprobs: dict | None = None, role: bool = False) -> dict:
    if chat:
        d: dict = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
        choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_}


def event(payload: dict) -> bytes:
    """One SSE event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


_TEXT, _LOGPROBS, _FINISH = "\x01", "\x02", "\x03"  # stand-ins, found in the JSON as "\u0001" ...


class ChunkEvents:
    """A stream's chunk events (as `event(chunk(...))`), from a JSON template made once per choice index: only
    the text, logprobs and finish reason are encoded per chunk (json.dumps of the whole chunk cost more)."""

    def __init__(self, rid: str, model: str, created: int, chat: bool):
        self.rid, self.model, self.created, self.chat = rid, model, created, chat
        self._templates: dict[int, list[str]] = {}

    def __call__(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> bytes:
        head, mid, tail, end = self._templates.get(index) or self._template(index)
        lps = "null" if logprobs is None else json.dumps(logprobs, ensure_ascii=False)
        reason = "null" if finish is None else json.dumps(finish)
        return f"{head}{_encode_str(text)}{mid}{lps}{tail}{reason}{end}".encode()

    def _template(self, index: int) -> list[str]:
        text = event(chunk(self.rid, self.model, self.created, self.chat, index, _TEXT, _FINISH, _LOGPROBS)).decode()
        parts = []
        for stand_in in (_TEXT, _LOGPROBS, _FINISH):
            part, text = text.split(json.dumps(stand_in), 1)
            parts.append(part)
        self._templates[index] = [*parts, text]
        return self._templates[index]


_encode_str = json.encoder.encode_basestring  # a str as JSON (non-ASCII kept), as json.dumps(ensure_ascii=False)


class Choices:
    """A request's choices (prompt i, sample j -> index i * n + j): final bodies and streamed deltas."""

    def __init__(self, prepared: PreparedRequest, chat: bool, token_texts: TokenTexts):
        self.parsed, self.chat, self.text_of = prepared.parsed, chat, token_texts
        n = prepared.parsed.n
        self.prompts = [prepared.prompts[i // n] for i in range(len(prepared.prompts) * n)]
        # Hold back the tail that could be the start of a stop string, so text cut by a stop never reaches the client.
        self.hold = max((len(s) for s in prepared.parsed.params.stop), default=1) - 1
        # the text only grows until the request ends: what was sent is its first sent_chars characters (sent_from:
        # the text they were taken from, a reference; the final text is decoded anew and is checked against it)
        self.sent_chars = [0] * len(self.prompts)
        self.sent_from = [""] * len(self.prompts)
        self.sent_tokens = [0] * len(self.prompts)
        self.offsets = [0] * len(self.prompts)
        self.started = [False] * len(self.prompts)

    def usage(self, outs: list[RequestOutput]) -> dict:
        n = self.parsed.n
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outs[::n])
        return usage(prompt_tokens, sum(len(c.token_ids) for out in outs for c in out.outputs))

    def final(self, outs: list[RequestOutput]) -> list[dict]:
        choices = []
        for i, out in enumerate(outs):
            for completion in out.outputs:  # one per engine request; several once the engine samples n itself
                choices.append(self._choice(len(choices), i, out, completion))
        return choices

    def _choice(self, index: int, i: int, out: RequestOutput, completion: CompletionOutput) -> dict:
        ids, entries = completion.token_ids, completion.logprobs
        if self.chat:
            logprobs = None if entries is None else chat_logprobs(ids, entries, self.text_of, self.parsed.logprobs)
            return chat_choice(index, completion.text, completion.finish_reason, logprobs)
        text, echo_ids, echo_entries = self._echo(i, out)
        logprobs = None
        if self.parsed.logprobs is not None:
            logprobs = completion_logprobs(echo_ids + ids, echo_entries + entries[: len(ids)], self.text_of)
        prompt_lps = None
        if self.parsed.prompt_logprobs and out.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.text_of)
        return completion_choice(index, text + completion.text, completion.finish_reason, logprobs, prompt_lps)

    def _echo(self, i: int, out: RequestOutput) -> tuple[str, list[int], list]:
        """The echoed prompt: its text, token ids and logprob entries (none unless echo)."""
        if not self.parsed.echo:
            return "", [], []
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return self.prompts[i].text, list(out.prompt_token_ids), list(entries)

    def delta(self, i: int, out: RequestOutput) -> tuple[str, str | None, dict | None, int]:
        """What choice i adds to the stream with this output: text, finish reason, logprobs of the new tokens,
        and their number (a chunk goes out for new tokens even when their text is held back or empty, as
        in vLLM: a model without a tokenizer streams empty texts, one chunk per step)."""
        completion = out.outputs[0]
        text, sent = completion.text, self.sent_chars[i]
        if out.finished:  # OutputText.final decodes every token at once: it must extend what was streamed
            end = len(text) if text.startswith(self.sent_from[i][:sent]) else sent
        else:
            end = max(0, len(text) - self.hold)
        delta = text[sent:end]  # only the new text: no copy or comparison of the whole text per step
        self.sent_chars[i], self.sent_from[i] = max(sent, end), text
        echo_text, echo_ids, echo_entries = ("", [], []) if self.started[i] else self._echo(i, out)
        self.started[i] = True
        ids = completion.token_ids[self.sent_tokens[i]:]
        entries = (completion.logprobs or [])[self.sent_tokens[i]: len(completion.token_ids)]
        self.sent_tokens[i] = len(completion.token_ids)
        logprobs = None
        if self.parsed.logprobs is not None and (ids or echo_ids):
            if self.chat:
                logprobs = chat_logprobs(ids, entries, self.text_of, self.parsed.logprobs)
            else:
                logprobs = completion_logprobs(echo_ids + ids, echo_entries + entries, self.text_of, self.offsets[i])
                self.offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return echo_text + delta, completion.finish_reason if out.finished else None, logprobs, len(ids)
