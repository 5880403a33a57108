"""Each architecture against HF transformers on the same tiny random weights, read from real files."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import DEVICES, make_tiny_model
from nanovllm import LLM, SamplingParams

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = {
    "llama-untied": ("llama", {}),
    "llama3-rope-tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "qwen2-qkv-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}),
}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from full forward passes (no cache): the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=[(c, d) for c in CASES for d in DEVICES], ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory):
    case, device = request.param
    arch, overrides = CASES[case]
    path = make_tiny_model(tmp_path_factory.mktemp(case), arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=48, device=device,
              dtype="float32")
    return hf, llm


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def test_last_position_logits_match_hf(pair):
    hf, llm = pair
    for prompt in random_prompts([1, 7, 33, 150, 300]):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=256), use_tqdm=False)[0]
        ours = out.outputs[0].logprobs[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        got = torch.tensor([ours[i] for i in range(256)])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_greedy_batch_matches_hf(pair):
    hf, llm = pair
    prompts = random_prompts([3, 20, 64, 100], seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 6)
