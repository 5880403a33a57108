"""Prompt logprobs and sliding-window perplexity against HF transformers' own loss."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.eval.ppl import perplexity, sliding_windows


def hf_perplexity(model, ids: list[int], max_length: int, stride: int) -> float:
    """HF's strided recipe: labels -100 before the new tokens, the model's own shifted loss."""
    total, count = 0.0, 0
    for w in sliding_windows(len(ids), max_length, stride):
        x = torch.tensor([ids[w.begin : w.end]])
        labels = x.clone()
        labels[:, : x.shape[1] - w.num_scored] = -100
        with torch.no_grad():
            loss = model(x, labels=labels).loss
        total += float(loss) * w.num_scored
        count += w.num_scored
    return math.exp(total / count)


def test_windows_score_every_token_but_the_first_once():
    for n, length, stride in [(10, 4, 2), (100, 32, 7), (5, 8, 4), (33, 32, 16)]:
        scored = []
        for w in sliding_windows(n, length, stride):
            assert w.end - w.begin <= length
            scored += list(range(w.end - w.num_scored, w.end))
        assert scored == list(range(1, n))
    # non-overlapping windows (stride == max_length): a window's first token has no context, as in HF
    windows = sliding_windows(100, 32, 32)
    assert [(w.begin, w.end, w.num_scored) for w in windows] == [(0, 32, 31), (32, 64, 31), (64, 96, 31), (96, 100, 3)]
    with pytest.raises(ValueError):
        sliding_windows(10, 4, 5)


def test_prompt_logprobs_match_hf_and_ignore_chunking(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    for budget in (4096, 16):  # whole prompt, and chunks of 16 mixed with nothing else
        llm = LLM(str(tiny_llama), device="cpu", kvcache_block_size=16, num_gpu_blocks=32,
                  max_num_batched_tokens=budget)
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # warms the prefix cache
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=1e-4)
        assert all(2 <= len(e) <= 3 for e in out.prompt_logprobs[1:])


def test_perplexity_matches_hf_on_tiny_model(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = LLM(str(tiny_llama), device="cpu", kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=64)
    ours = perplexity(llm, ids, max_length=128, stride=48, use_tqdm=False)["perplexity"]
    assert abs(ours / hf_perplexity(hf, ids, 128, 48) - 1) < 5e-3


@pytest.mark.slow
def test_perplexity_matches_hf_on_smollm2(smollm2_path):
    from transformers import AutoTokenizer

    text = ("The history of the lighthouse begins with fires lit on hilltops to guide ships at night. "
            "Later, towers were built so that the light could be seen from farther away, and lenses "
            "focused the beam across the water. Keepers tended the lamps through storms and calm seas. ") * 15
    ids = AutoTokenizer.from_pretrained(smollm2_path)(text).input_ids
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    llm = LLM(str(smollm2_path), device="cpu", kvcache_block_size=16, num_gpu_blocks=256)
    ours = perplexity(llm, ids, max_length=256, stride=128, use_tqdm=False)["perplexity"]
    theirs = hf_perplexity(hf, ids, 256, 128)
    assert abs(ours / theirs - 1) < 5e-3, (ours, theirs)
