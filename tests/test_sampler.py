"""The sampling filters, checked against hand-computed distributions."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused sampler below runs in Triton's interpreter

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


# ---------------------------------------------------------------------------------------------
# The one-pass Triton sampler (CUDA path; here in Triton's interpreter on the CPU)


@pytest.fixture(scope="module")
def fused():
    pytest.importorskip("triton")
    from nanovllm.kernels import triton_sampler

    return triton_sampler


def test_fused_sampler_frequencies_follow_probabilities(fused):
    """Five likely tokens in a 150-token vocabulary streamed in two chunks, at temperature 0.8. The
    interpreter affords few draws (a loose check); on CUDA 20,000 (within 4 standard deviations)."""
    cuda = torch.cuda.is_available()
    n, device = (20000, "cuda") if cuda else (500, "cpu")
    logits = torch.full((1, 150), -30.0, device=device)
    logits[0, [0, 7, 70, 129, 149]] = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.5], device=device)
    tokens = fused.sample_tokens(logits.repeat(n, 1), torch.full((n,), 0.8, device=device),
                                 torch.arange(n, device=device), chunk=128)
    freq = torch.bincount(tokens.cpu(), minlength=150).float() / n
    torch.testing.assert_close(freq, (logits[0].cpu() / 0.8).softmax(-1), atol=4 * (0.25 / n) ** 0.5, rtol=0)


def test_fused_sampler_greedy_rows_take_the_first_maximum(fused):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(3, 5000, device=device)
    logits[1, 10] = logits[1, 4000] = 100.0  # a tie across chunks: the first one wins, as in torch.argmax
    temps = torch.tensor([0.0, 0.0, 0.7], device=device)
    tokens = fused.sample_tokens(logits, temps, torch.tensor([1, 2, 3], device=device))
    assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist() == [logits[0].argmax().item(), 10]


def test_fused_sampler_is_deterministic_per_seed(fused):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.zeros(4, 300, device=device)  # uniform: only the noise decides
    temps = torch.ones(4, device=device)
    a = fused.sample_tokens(logits, temps, torch.tensor([5, 5, 6, 7], device=device))
    b = fused.sample_tokens(logits, temps, torch.tensor([5, 9, 6, 7], device=device))
    assert a[0] == a[1] == b[0] and a[2] == b[2] and a[3] == b[3]
    assert len(set(fused.sample_tokens(logits[:1].repeat(50, 1), temps[:1].repeat(50),
                                       torch.arange(50, device=device)).tolist())) > 30
