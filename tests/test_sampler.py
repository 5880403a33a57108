"""The sampling filters, checked against hand-computed distributions."""
from __future__ import annotations

import torch

from nanovllm.layers.sampler import filter_logits, sample
from nanovllm.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))


def kept(params: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(LOGITS.clone(), [params]))[0].nonzero().flatten().tolist()


def test_top_k():
    assert kept(SamplingParams(top_k=2)) == [0, 1]


def test_top_p_keeps_smallest_prefix_reaching_p():
    assert kept(SamplingParams(top_p=0.5)) == [0]
    assert kept(SamplingParams(top_p=0.6)) == [0, 1]
    assert kept(SamplingParams(top_p=0.9)) == [0, 1, 2]


def test_min_p():
    assert kept(SamplingParams(min_p=0.4)) == [0, 1]  # 0.25 >= 0.4 * 0.5


def test_temperature_sharpens():
    probs = filter_logits(LOGITS.clone(), [SamplingParams(temperature=0.5)]).softmax(-1)
    expected = torch.tensor([[0.25, 0.0625, 0.0225, 0.01]])
    torch.testing.assert_close(probs, expected / expected.sum())


def test_sampling_frequencies_follow_probabilities():
    g = torch.Generator().manual_seed(0)
    n = 20000
    logits = LOGITS.repeat(n, 1)
    params = [SamplingParams(temperature=1.0)] * n
    tokens = torch.tensor(sample(logits, params, [None] * n, g).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, LOGITS.exp()[0], atol=0.015, rtol=0)


def test_greedy_rows_take_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None], torch.Generator().manual_seed(0))
    assert out.token_ids == [1, 0]
