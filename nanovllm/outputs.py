"""What generate() returns, shaped like vLLM's RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    time_to_first_token: float | None  # seconds from add_request to the first sampled token
    time_per_output_token: float | None  # mean seconds between later tokens
    finished_time: float | None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    prefill_density: float = 1.0  # share of causal (query block, KV block) pairs computed in prefill
    decode_density: float = 1.0  # share of KV blocks read per decode step (layers and KV heads averaged)
    host_kv_bytes_read: int = 0  # KV bytes copied host -> device for this request (CPU offload)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token; None for the first

    # Shortcuts for the single-completion case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
