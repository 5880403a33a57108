"""Incremental detokenization: new text is released only once it no longer ends in a partial character."""
from __future__ import annotations

from collections.abc import Sequence

from nanovllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Start a few tokens inside the prompt so the first output token is decoded in context
        # (leading spaces of SentencePiece-style tokens depend on the token before).
        self.tokens = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = decode(self.tokens[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full_text[len(prefix_text) :]
        return ""


class OutputText:
    """One request's output text: tokens detokenized as they arrive, cut before the first stop string.

    The engine keeps one per request when it detokenizes itself; the server keeps one per request in its
    detokenizer thread instead, so both produce the same text for the same tokens (`for_params`).
    Stop strings are not looked for in the text of the first `min_tokens` tokens; with
    `include_stop_str_in_output` the text is cut after the matched stop string instead of before it.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = stop
        self.min_tokens = min_tokens
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.num_tokens = 0
        # the text no stop string may end within: produced below min_tokens, or already searched (so that each
        # step searches only its new text and the stop strings' length before it, not the whole text again)
        self.checked = 0
        self.stop_at: int | None = None  # where the text is cut for a matched stop string

    @classmethod
    def for_params(cls, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> "OutputText":
        return cls(tokenizer, prompt_token_ids, params.stop, params.min_tokens, params.include_stop_str_in_output,
                   params.skip_special_tokens)

    def add(self, token_id: int) -> None:
        self.text += self.detokenizer.add(token_id)
        self.num_tokens += 1

    def match_stop(self) -> bool:
        """True once the text holds a stop string; the text is then cut where the earliest one begins
        (or ends, with include_stop_str_in_output). Always False within the first min_tokens tokens."""
        if self.num_tokens <= self.min_tokens:
            self.checked = len(self.text)
            return False
        if self.stop_at is None:
            found = [(pos, stop) for stop in self.stop
                     if (pos := self.text.find(stop, max(0, self.checked - len(stop) + 1))) != -1]
            if found:
                pos, stop = min(found)
                self.stop_at = pos + len(stop) if self.include_stop else pos
            self.checked = len(self.text)
        if self.stop_at is not None:
            self.text = self.text[: self.stop_at]
            return True
        return False

    def final(self, output_token_ids: Sequence[int]) -> str:
        """A finished request's text: all output tokens decoded at once, unless a stop string cut it."""
        if self.stop_at is not None:
            return self.text
        return self.tokenizer.decode(list(output_token_ids), skip_special_tokens=self.skip_special_tokens)
