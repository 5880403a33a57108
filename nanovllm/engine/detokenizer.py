"""Incremental detokenization: new text is released only once it no longer ends in a partial character."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        # Start a few tokens inside the prompt so the first output token is decoded in context
        # (leading spaces of SentencePiece-style tokens depend on the token before).
        self.tokens = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
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
    detokenizer thread instead, so both produce the same text for the same tokens.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stop = stop
        self.text = ""
        self.stop_at: int | None = None  # where a matched stop string begins in the text

    def add(self, token_id: int) -> None:
        self.text += self.detokenizer.add(token_id)

    def match_stop(self) -> bool:
        """True once the text holds a stop string; the text is then cut where the earliest one begins."""
        for stop in self.stop:
            pos = self.text.find(stop)
            if pos != -1:
                self.stop_at = pos if self.stop_at is None else min(pos, self.stop_at)
        if self.stop_at is not None:
            self.text = self.text[: self.stop_at]
            return True
        return False

    def final(self, output_token_ids: list[int]) -> str:
        """A finished request's text: all output tokens decoded at once, unless a stop string cut it."""
        if self.stop_at is not None:
            return self.text
        return self.tokenizer.decode(output_token_ids, skip_special_tokens=True)
