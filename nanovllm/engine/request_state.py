"""What the engine keeps of one request between steps: its samples (sequences with their text), the
stop checks after each token, and the `RequestOutput` it reports."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanovllm.engine.detokenizer import OutputText
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams


@dataclass
class SampleState:
    index: int  # CompletionOutput.index
    seq: Sequence
    text: OutputText | None  # None: no tokenizer, or the caller detokenizes (the server does, in its own thread)

    def completion(self) -> CompletionOutput:
        seq = self.seq
        text = ""
        if self.text is not None:
            text = self.text.final(seq.output_token_ids) if seq.is_finished else self.text.text
        token_ids = seq.output_token_ids
        if token_ids and token_ids[-1] == PLACEHOLDER:  # the next token, launched but not yet here (async)
            token_ids.pop()
        return CompletionOutput(self.index, text, token_ids, seq.finish_reason,
                                list(seq.logprobs) if seq.params.logprobs is not None else None)


@dataclass
class RequestState:
    request_id: str
    samples: list[SampleState]
    prompt: str | None
    prompt_token_ids: list[int]  # one list shared by every output of the request
    stop_token_ids: frozenset[int]
    unqueued: list[Sequence]  # samples 1..n-1 until the first one has computed the prompt

    @property
    def seq(self) -> Sequence:
        return self.samples[0].seq

    @property
    def finished(self) -> bool:
        samples = self.samples
        if len(samples) == 1:  # read per request and step: no generator for the common case
            return samples[0].seq.is_finished
        return all(sample.seq.is_finished for sample in samples)

    def stop_reason(self, sample: SampleState, token: int, num_tokens: int, eos_token_ids,
                    max_model_len: int) -> str | None:
        """Why the sample ends with this token at position num_tokens - 1, or None."""
        params, num_output = sample.seq.params, num_tokens - sample.seq.num_prompt_tokens
        if num_output > params.min_tokens:
            if not params.ignore_eos and token in eos_token_ids:
                return "stop"
            if token in self.stop_token_ids:
                return "stop"
        if params.stop and sample.text is not None and sample.text.match_stop():
            return "stop"
        if num_output >= params.max_tokens or num_tokens >= max_model_len:
            return "length"
        return None

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [sample.completion() for sample in self.samples], self.finished, self.metrics(),
                             self.prompt_logprobs())

    def metrics(self) -> RequestMetrics:
        seq = self.seq
        return RequestMetrics(seq.arrival_time, seq.time_to_first_token, seq.time_per_output_token,
                              seq.finish_time, seq.num_cached_tokens, seq.num_preemptions,
                              seq.density(seq.prefill_blocks), seq.density(seq.decode_blocks), seq.host_kv_bytes_read)

    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        seq = self.seq
        return list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample index's own params: n=1, seed + index, prompt logprobs only on the first."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, n=1, best_of=None, seed=seed,
                               prompt_logprobs=params.prompt_logprobs if index == 0 else None)
