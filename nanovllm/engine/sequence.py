"""A request's token state, KV block table and timings as it moves through the engine."""
from __future__ import annotations

import itertools
import time
from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


PLACEHOLDER = -1  # a sampled token still on the device (async scheduling)


class Sequence:
    _ids = itertools.count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int, prompt: str | None = None,
                 parent: Sequence | None = None):
        self.seq_id = next(Sequence._ids)
        self.parent = parent  # n > 1: the request's first sample, whose prompt KV blocks this one shares
        self.min_tokens_stop_ids: list[int] = []  # EOS and stop_token_ids, masked below params.min_tokens
        self.status = SequenceStatus.WAITING
        self.prompt = prompt
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        # logits go back to the host (logprobs), or sampling needs the tokens still in flight (penalties): its
        # steps run synchronously under async scheduling (read per row and step, so kept, not derived)
        self.synchronous_sampling = params.logprobs is not None or params.prompt_logprobs is not None \
            or params.penalizes
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] = [None]  # the first token has no context
        self.num_preemptions = 0
        # Attention work, summed over steps, layers and KV heads: block pairs (attended, visible) in prefill
        # rows and KV blocks (read, present) in decode rows; host KV bytes copied to the device for it.
        self.prefill_blocks = [0, 0]
        self.decode_blocks = [0, 0]
        self.host_kv_bytes_read = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def add_attention_work(self, prefill: tuple[int, int], decode: tuple[int, int], host_kv_bytes: int) -> None:
        for total, part in ((self.prefill_blocks, prefill), (self.decode_blocks, decode)):
            total[0] += part[0]
            total[1] += part[1]
        self.host_kv_bytes_read += host_kv_bytes

    def density(self, blocks: list[int]) -> float:
        """Share of the visible blocks attended (1.0 when nothing was counted: dense)."""
        return blocks[0] / blocks[1] if blocks[1] else 1.0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids.append(token_id)

    def set_token(self, index: int, token_id: int) -> None:
        """Fill a PLACEHOLDER appended when the token's step was launched (async scheduling)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids[index] = token_id

    def reset_for_recompute(self) -> None:
        """Preempted: the KV is dropped; prompt and generated tokens are recomputed later."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.prompt_logprobs = [None]  # recomputed with the prompt
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)
