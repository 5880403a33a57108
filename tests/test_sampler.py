"""The sampling filters, checked against hand-computed distributions."""
from __future__ import annotations

import pytest
import torch

from nanovllm.layers.sampler import filter_logits, sample
from nanovllm.sampling_params import SamplingParams
from sampling_reference import reference_adjust

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
    """Five likely tokens in a 150-token vocabulary streamed in two chunks, at temperature 0.8: four of them in one
    lane of the first chunk (a quarter chunk apart: one Philox call draws their noise), the fifth in the second.
    The interpreter affords few draws (a loose check); on CUDA 20,000 (within 4 standard deviations)."""
    cuda = torch.cuda.is_available()
    n, device = (20000, "cuda") if cuda else (500, "cpu")
    logits = torch.full((1, 150), -30.0, device=device)
    logits[0, [5, 37, 69, 101, 133]] = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.5], device=device)
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


def test_fused_sampler_greedy_ties_within_a_chunk_take_the_first(fused):
    """Ties in one lane a quarter chunk apart, and a later lane's earlier quarter against an earlier lane's later
    one (chunk 64: a quarter is 16 entries)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(2, 200, device=device)
    logits[0, [20, 36, 52]] = 100.0  # lane 4, quarters 1-3
    logits[1, [49, 21]] = 100.0  # lane 1 quarter 3, lane 5 quarter 1
    tokens = fused.sample_tokens(logits, torch.zeros(2, device=device), torch.tensor([1, 2], device=device), chunk=64)
    assert tokens.tolist() == logits.argmax(-1).tolist() == [20, 21]


def test_fused_sampler_is_deterministic_per_seed(fused):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.zeros(4, 300, device=device)  # uniform: only the noise decides
    temps = torch.ones(4, device=device)
    a = fused.sample_tokens(logits, temps, torch.tensor([5, 5, 6, 7], device=device))
    b = fused.sample_tokens(logits, temps, torch.tensor([5, 9, 6, 7], device=device))
    assert a[0] == a[1] == b[0] and a[2] == b[2] and a[3] == b[3]
    assert len(set(fused.sample_tokens(logits[:1].repeat(50, 1), temps[:1].repeat(50),
                                       torch.arange(50, device=device)).tolist())) > 30


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_fused_sampler_tokens_do_not_depend_on_the_vocabulary_splits(fused, splits):
    """Each entry's noise is drawn at its own index, and the splits' maxima reduce to the first maximum: the same
    tokens whatever the number of programs per row (greedy and sampled rows, ties within and across splits, a
    vocabulary that is not a multiple of the chunk)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(splits)
    logits = torch.randn(6, 1000, device=device, generator=g) * 3
    logits[0, [5, 700]] = 50.0  # a greedy tie across splits: the first wins
    logits[1, [300, 301]] = 50.0
    temps = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.5, 0.9], device=device)
    seeds = torch.tensor([3, 4, 5, 6, 7, 8], device=device)
    want = fused.sample_tokens(logits, temps, seeds, chunk=64, splits=1)
    assert want[:2].tolist() == [5, 300] == logits[:2].argmax(-1).tolist()
    assert fused.sample_tokens(logits, temps, seeds, chunk=64, splits=splits).tolist() == want.tolist()


@pytest.mark.parametrize("batch, vocab, chunk, sms", [(1, 151936, 2048, 132), (16, 151936, 2048, 132),
                                                      (256, 151936, 2048, 132), (512, 151936, 2048, 132),
                                                      (3, 150, 128, 132), (1, 49152, 2048, 8)])
def test_vocab_splits_cover_the_vocabulary_in_whole_chunks_without_an_empty_split(fused, batch, vocab, chunk, sms):
    splits, per_split = fused.vocab_splits(batch, vocab, chunk, sms)
    assert per_split % chunk == 0 and (splits - 1) * per_split < vocab <= splits * per_split
    assert splits == 1 or batch * (splits - 1) < fused.PROGRAMS_PER_SM * sms  # no more programs than asked for


# ---------------------------------------------------------------------------------------------
# Logit adjustments (logit_bias, min_tokens, penalties) against a per-token PyTorch reference


def adjusted_batch(vocab: int = 150, device: str = "cpu"):
    from nanovllm.layers.sampler import RowHistory

    torch.manual_seed(1)
    logits = (torch.randn(6, vocab) * 3).to(device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, max_tokens=32),
        SamplingParams(temperature=0.7, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias={3: 100.0, 4: -5.5}),
        SamplingParams(temperature=0.0, min_tokens=4),
        SamplingParams(temperature=0.9, repetition_penalty=0.6, frequency_penalty=-1.0, logit_bias={7: 2.0}),
    ]
    prompt, output = [5, 9, 9, 140, 12, 77], [12, 13, 13, 13, 100, 5]
    history = [None, RowHistory(6, prompt, output), RowHistory(6, None, output), None,
               RowHistory(2, None, None, [int(logits[4].argmax()), 8]), RowHistory(6, prompt, output)]
    return logits, params, history


def test_adjust_logits_matches_the_reference():
    from nanovllm.layers.sampler import adjust_logits

    logits, params, history = adjusted_batch()
    expected = reference_adjust(logits, params, history)
    torch.testing.assert_close(adjust_logits(logits, params, history), expected)
    assert not torch.equal(expected[1:], logits[1:]) and torch.equal(expected[0], logits[0])


def test_min_tokens_mask_ends_once_reached():
    from nanovllm.layers.sampler import RowHistory, adjust_logits

    logits = torch.zeros(1, 8)
    params = [SamplingParams(min_tokens=3)]
    assert adjust_logits(logits, params, [RowHistory(2, stop_token_ids=[1, 2])])[0, 1:3].isinf().all()
    assert torch.equal(adjust_logits(logits, params, [RowHistory(3, stop_token_ids=[1, 2])]), logits)


def test_greedy_rows_take_the_argmax_of_adjusted_logits():
    logits, params, history = adjusted_batch()
    expected = reference_adjust(logits, params, history).argmax(-1)
    out = sample(logits, params, [None] * 6, torch.Generator().manual_seed(0), history)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert [out.token_ids[i] for i in greedy] == expected[greedy].tolist()
    assert out.token_ids[3] == 3 and expected[1] != logits[1].argmax()  # the bias and the penalty decide


def test_penalized_sampling_follows_the_adjusted_distribution():
    from nanovllm.layers.sampler import RowHistory

    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    h = RowHistory(3, [1], [0, 0, 2])
    n = 20000
    tokens = torch.tensor(sample(logits.repeat(n, 1), [p] * n, [None] * n, torch.Generator().manual_seed(0),
                                 [h] * n).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, reference_adjust(logits, [p], [h])[0].softmax(-1), atol=0.015, rtol=0)


def test_without_adjustments_the_existing_path_runs(monkeypatch):
    """No penalty, bias or min_tokens in the batch: adjust_logits is never called."""
    from nanovllm.layers import sampler as sampler_module

    def refuse(*args):
        raise AssertionError("adjust_logits called on a batch without adjustments")

    monkeypatch.setattr(sampler_module, "adjust_logits", refuse)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05)]
    out = sample(torch.randn(2, 50), params, [None, None], torch.Generator().manual_seed(0))
    assert len(out.token_ids) == 2
    with pytest.raises(AssertionError, match="adjust_logits called"):
        sample(torch.randn(1, 50), [SamplingParams(logit_bias={1: 1.0})], [None], None)


def test_fused_sampler_path_adjusts_logits_like_the_reference(fused, monkeypatch):
    """The Triton path (forced on here) gets the adjusted logits: greedy rows take their argmax."""
    from nanovllm.layers import sampler as sampler_module

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits, params, history = adjusted_batch(device=device)
    seen, kernel = [], fused.sample_tokens

    def recording(logits, temps, seeds, chunk=fused.CHUNK):
        seen.append(logits.clone())
        return kernel(logits, temps, seeds, chunk=chunk)

    monkeypatch.setattr(sampler_module, "_use_fused", lambda logits, params: True)
    monkeypatch.setattr(fused, "sample_tokens", recording)
    out = sample(logits, params, [None] * 6, None, history)
    expected = reference_adjust(logits, params, history)
    torch.testing.assert_close(seen[0], expected)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert [out.token_ids[i] for i in greedy] == expected[greedy].argmax(-1).tolist()


def test_fused_sampler_path_without_adjustments_is_unchanged(fused, monkeypatch):
    from nanovllm.layers import sampler as sampler_module

    def refuse(*args):
        raise AssertionError("adjust_logits called")

    monkeypatch.setattr(sampler_module, "adjust_logits", refuse)
    monkeypatch.setattr(sampler_module, "_use_fused", lambda logits, params: True)
    logits = torch.randn(2, 300, device="cuda" if torch.cuda.is_available() else "cpu")
    out = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None], None)
    assert out.token_ids == logits.argmax(-1).tolist()
