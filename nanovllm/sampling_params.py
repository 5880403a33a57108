"""Per-request sampling options, validated on construction (vLLM-compatible names).

Types are exact (a bool is not a number), numbers finite, integers within int64 (nanovllm/validation.py).
A wrong type raises TypeError, a value out of range ValueError; both name the field first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm import validation as v

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (as in vLLM): 1/T would overflow the scores


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below 1e-5) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None  # in [0, 2**63)
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N >= 0: sampled token plus top-N per step
    prompt_logprobs: int | None = None  # None: none; N >= 0: each prompt token's logprob plus top-N

    def __post_init__(self) -> None:
        self.stop = v.strings("stop", self.stop)
        self.stop_token_ids = v.token_ids("stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        self.verify()
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)

    def verify(self) -> None:
        """Raise TypeError/ValueError naming the first bad field (also after fields were changed by hand)."""
        v.integer("max_tokens", self.max_tokens, 1)
        v.number("temperature", self.temperature, 0.0)
        v.number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        v.integer("top_k", self.top_k, -1)
        v.number("min_p", self.min_p, 0.0, 1.0)
        v.optional_integer("seed", self.seed, 0)
        v.optional_integer("logprobs", self.logprobs, 0)
        v.optional_integer("prompt_logprobs", self.prompt_logprobs, 0)
        v.boolean("ignore_eos", self.ignore_eos)
        if not isinstance(self.stop, list):
            raise v.InvalidType("stop", f"must be a list of strings once constructed, got {v.type_name(self.stop)}")
        v.strings("stop", self.stop)
        v.token_ids("stop_token_ids", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
