"""Per-request sampling options, validated on construction (vLLM-compatible names).

Types are exact (a bool is not a number), numbers finite, integers within int64 (nanovllm/validation.py).
A wrong type raises TypeError, a value out of range ValueError; both name the field first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanovllm import validation as v

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (as in vLLM): 1/T would overflow the scores
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in vLLM and OpenAI
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100], as in OpenAI's API


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
    n: int = 1  # samples of the prompt, returned as RequestOutput.outputs[0..n-1]; they share the prompt's KV
    best_of: int | None = None  # only None or n: ranking more samples than are returned is not built
    repetition_penalty: float = 1.0  # > 0; over prompt and output tokens: positive logits / p, negative * p
    presence_penalty: float = 0.0  # in [-2, 2]; subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]; subtracted once per occurrence in the output
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings not checked, until this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to the logits
    include_stop_str_in_output: bool = False  # the text keeps a matched stop string
    skip_special_tokens: bool = True  # special tokens are left out of the text

    def __post_init__(self) -> None:
        self.stop = v.strings("stop", self.stop)
        self.stop_token_ids = v.token_ids("stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        self.verify()
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            setattr(self, name, float(getattr(self, name)))

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
        self._verify_extensions()

    def _verify_extensions(self) -> None:
        v.integer("n", self.n, 1)
        if self.best_of is not None:
            v.integer("best_of", self.best_of, self.n)
            if self.best_of != self.n:
                raise v.InvalidValue("best_of", f"must be None or equal to n={self.n}: returning the best {self.n} "
                                                f"of {self.best_of} samples is not supported")
        v.number("repetition_penalty", self.repetition_penalty, 0.0, low_open=True)
        v.number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        v.number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        v.integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        _logit_bias(self.logit_bias)
        v.boolean("include_stop_str_in_output", self.include_stop_str_in_output)
        v.boolean("skip_special_tokens", self.skip_special_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalizes(self) -> bool:
        """Whether sampling needs the sequence's earlier tokens (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits before sampling (penalties, bias, min_tokens)."""
        return self.penalizes or bool(self.logit_bias) or self.min_tokens > 0


def _logit_bias(value: Any) -> dict[int, float] | None:
    """None or {token id: bias}; ids are checked against the vocabulary at admission."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise v.InvalidType("logit_bias", f"must be a dict of token id -> bias, got {v.type_name(value)}")
    result = {}
    for token, bias in value.items():
        if not v.is_int(token):
            raise v.InvalidType("logit_bias", f"keys must be integer token ids, got {v.type_name(token)}")
        v.integer(f"logit_bias[{token}]", token, 0)
        result[token] = v.number(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return result
