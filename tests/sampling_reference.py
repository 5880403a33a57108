"""A per-token PyTorch reference of the sampler's logit adjustments, shared by the sampler and engine tests."""
from __future__ import annotations

import torch

from nanovllm.sampling_params import SamplingParams


def reference_adjust(logits: torch.Tensor, params: list[SamplingParams], history: list) -> torch.Tensor:
    """HF/vLLM semantics one token at a time: bias, min_tokens mask, repetition over prompt + output
    (positive logits divided, negative multiplied), frequency and presence over the output."""
    out = logits.clone()
    for row, p, h in zip(out, params, history):
        for token, bias in (p.logit_bias or {}).items():
            row[token] += bias
        if h is not None and h.num_output_tokens < p.min_tokens:
            row[h.stop_token_ids] = float("-inf")
        if h is None:
            continue
        output = h.output_token_ids or []
        if p.repetition_penalty != 1.0:
            for token in set(h.prompt_token_ids or []) | set(output):
                row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
        for token in set(output):
            row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out
