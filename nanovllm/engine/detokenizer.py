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
