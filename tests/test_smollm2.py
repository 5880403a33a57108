"""SmolLM2-135M-Instruct (real weights) against HF transformers, greedy, token for token."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import DEVICES
from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

STORY = ("The lighthouse keeper counted the ships every evening, writing their names in a worn leather book. "
         "Storms came and went, and the lamp never failed, because he polished the lens each morning. ") * 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    STORY + "Question: what did the keeper write in his book? Answer:",
    STORY + "Question: why did the lamp never fail? Answer:",  # shares a ~400-token prefix with the one above
    "List the planets of the solar system in order from the sun: Mercury,",
    "Translate to French: 'Good morning, how are you?'",
    "A" * 3 + " quick summary of photosynthesis: plants use sunlight to",
]
MAX_NEW = 24


def hf_greedy(model, tokenizer, ids: list[int], device: str) -> list[int]:
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=MAX_NEW, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


@pytest.fixture(scope="module", params=DEVICES)
def setup(request, smollm2_path):
    device = request.param
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).to(device).eval()
    llm = LLM(str(smollm2_path), device=device, dtype="float32", kvcache_block_size=16, num_gpu_blocks=512,
              max_num_batched_tokens=512)
    return device, tokenizer, hf, llm


def test_greedy_batch_equals_hf(setup):
    device, tokenizer, hf, llm = setup
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    lengths = sorted(len(o.prompt_token_ids) for o in outs)
    assert lengths[0] < 10 and lengths[-1] > 400
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf, tokenizer, ids, device), prompt[-60:]
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    # the second pass serves the shared story prefix from the cache and must not change a token
    again = llm.generate(PROMPTS[3:5], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[3:5]]
    assert all(o.metrics.num_cached_tokens >= 384 for o in again)


def test_chat_equals_hf(setup):
    device, tokenizer, hf, llm = setup
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a terse assistant."},
         {"role": "user", "content": "Name two primary colours."}],
    ]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for conv, out in zip(conversations, outs):
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert out.prompt_token_ids == list(ids)
        assert out.token_ids == hf_greedy(hf, tokenizer, list(ids), device)
    assert "Paris" in outs[0].text


def test_stop_string_is_removed(setup):
    _, _, _, llm = setup
    full = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)[0].text
    word = full.split()[1]
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[word]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(word)]


@pytest.mark.cuda
def test_default_cuda_sizing_and_bf16(smollm2_path):
    """The KV pool sized from gpu_memory_utilization, bf16 weights: serves a chat request."""
    llm = LLM(str(smollm2_path), device="cuda", gpu_memory_utilization=0.5)
    assert llm.runner.dtype == torch.bfloat16 and llm.block_manager.num_blocks > 0
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.text
