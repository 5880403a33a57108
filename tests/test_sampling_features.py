"""vLLM's extra sampling options through the whole engine: penalties, logit_bias and min_tokens against a
transformers reference, n samples sharing the prompt's KV blocks, and the stop-string options."""
from __future__ import annotations

import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import OutputText
from nanovllm.layers.sampler import RowHistory
from sampling_reference import reference_adjust

PROMPT = [5, 17, 17, 200, 3, 99, 42, 42, 42, 8]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, max_model_len=256, device="cpu")


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], params: SamplingParams, stop_ids: list[int]) -> list[int]:
    """Greedy decoding with transformers, the logits adjusted by the per-token reference."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([prompt + tokens])).logits[:, -1].float()
            history = RowHistory(len(tokens), prompt, list(tokens), stop_ids)
            token = int(reference_adjust(logits, [params], [history]).argmax(-1))
            tokens.append(token)
            if len(tokens) > params.min_tokens and token in stop_ids:
                break
    return tokens


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(frequency_penalty=-0.8, logit_bias={7: 3.0, 42: -100.0}),
    dict(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.0, logit_bias={1: 2.5}),
])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_match_transformers_with_the_reference(tiny_llama, hf_model, options, async_scheduling):
    engine = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, max_model_len=256, device="cpu",
                 async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **options)
    got = engine.generate([PROMPT], params, use_tqdm=False)[0].token_ids
    assert got == hf_greedy(hf_model, PROMPT, params, [])
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert plain[0].token_ids != got  # the options changed the output


def test_min_tokens_masks_stop_tokens_until_reached(llm, hf_model):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    stop = greedy[1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop], min_tokens=5)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert stop not in out.token_ids[:5] and len(out.token_ids) > 5
    assert out.token_ids == hf_greedy(hf_model, PROMPT, params, sorted(llm.eos_token_ids | {stop}))
    early = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  stop_token_ids=[stop]), use_tqdm=False)[0]
    assert early.token_ids == greedy[: greedy.index(stop) + 1] and early.finish_reason == "stop"


def test_plain_requests_never_adjust_logits(llm, monkeypatch):
    from nanovllm.layers import sampler

    def refuse(*args):
        raise AssertionError("adjust_logits called")

    monkeypatch.setattr(sampler, "adjust_logits", refuse)
    params = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0.8, top_k=5, max_tokens=4)]
    assert len(llm.generate([PROMPT, PROMPT], params, use_tqdm=False)) == 2
    with pytest.raises(Exception, match="adjust_logits called"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, presence_penalty=0.5), use_tqdm=False)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(logit_bias={256: 1.0}), "logit_bias token id 256 is outside the vocabulary \\[0, 256\\)"),
    (SamplingParams(n=9), "n=9 exceeds max_num_seqs=8"),
])
def test_request_values_beyond_the_model_are_refused(tiny_llama, params, message):
    engine = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=16, max_num_seqs=8, device="cpu")
    with pytest.raises(ValueError, match=message):
        engine.generate([PROMPT], params, use_tqdm=False)


# ---- n samples per prompt ---------------------------------------------------------------------


def test_n_greedy_samples_are_identical(llm):
    out = llm.generate([PROMPT, [1, 2, 3]], SamplingParams(temperature=0, n=3, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    single = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out[0].outputs] == [0, 1, 2] and out[0].prompt_token_ids == PROMPT
    assert all(c.token_ids == single.token_ids and c.finish_reason == "length" for c in out[0].outputs)
    assert len(out[1].outputs) == 3
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_n_seeded_samples_are_reproducible_and_sample_i_uses_seed_plus_i(llm):
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=10, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([PROMPT, [4, 4]], [params, params], use_tqdm=False)[0].outputs]
    assert first == again and len({tuple(t) for t in first}) == 3
    for i, tokens in enumerate(first):
        one = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True)
        assert llm.generate([PROMPT], one, use_tqdm=False)[0].token_ids == tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_samples_share_the_prompt_blocks(tiny_llama, async_scheduling):
    """Without the prefix cache, the other samples start from the first one's prompt blocks: 4 samples
    of a 100-token prompt hold 6 shared full blocks, and each computes only the last 4 prompt tokens."""
    engine = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, device="cpu",
                 enable_prefix_caching=False, async_scheduling=async_scheduling)
    prompt = [(7 * i) % 256 for i in range(100)]
    params = SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=20, ignore_eos=True)
    computed, peak = 0, 0
    rid = engine.add_request(prompt, params)
    seqs = [s.seq for s in engine.requests[rid].samples]
    schedule = engine.scheduler.schedule

    def counting():
        nonlocal computed
        scheduled = schedule()
        computed += sum(item.num_new_tokens for item in scheduled if item.seq.num_output_tokens == 0)
        return scheduled

    engine.scheduler.schedule = counting
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
        engine.block_manager.check_invariants([s for s in seqs if not s.is_finished])
    blocks_per_sample = -(-(100 + 20) // 16)
    assert peak == blocks_per_sample + 3 * (blocks_per_sample - 6) < 4 * blocks_per_sample
    assert computed == 100 + 3 * 4
    assert [s.num_cached_tokens for s in seqs] == [0, 96, 96, 96]
    final = outputs[-1]
    assert final.finished and [len(c.token_ids) for c in final.outputs] == [20] * 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_aborting_an_n_request_frees_every_sample(llm):
    rid = llm.add_request(PROMPT, SamplingParams(n=4, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        llm.step()
    assert sum(not s.seq.is_finished for s in llm.requests[rid].samples) == 4
    llm.abort_request(rid)
    assert not llm.has_unfinished_requests() and rid not in llm.requests
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_n_request_streams_every_sample(llm):
    rid = llm.add_request(PROMPT, SamplingParams(temperature=0, n=2, max_tokens=3, ignore_eos=True))
    seen = []
    while llm.has_unfinished_requests():
        seen += [o for o in llm.step() if o.request_id == rid]
    assert [len(o.outputs) for o in seen] == [2] * len(seen)
    assert not seen[0].outputs[1].token_ids and seen[-1].finished
    assert [len(c.token_ids) for c in seen[-1].outputs] == [3, 3]


# ---- stop strings and special tokens ----------------------------------------------------------


class CharTokenizer:
    """Token i is chr(ord('a') + i); token 25 is a special token that decodes to <s>."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if i == 25 and skip_special_tokens else "<s>" if i == 25 else chr(97 + i) for i in ids)


def feed(text: OutputText, word: str) -> list[bool]:
    stopped = []
    for ch in word:
        text.add(ord(ch) - 97)
        stopped.append(text.match_stop())
    return stopped


def test_stop_string_is_cut_before_or_kept_with_include_stop_str_in_output():
    cut = OutputText(CharTokenizer(), [], ["cd"])
    assert feed(cut, "abcde") == [False, False, False, True, True] and cut.text == "ab"
    kept = OutputText.for_params(CharTokenizer(), [], SamplingParams(stop="cd", include_stop_str_in_output=True))
    assert feed(kept, "abcd") == [False, False, False, True] and kept.text == "abcd"


def test_stop_strings_are_not_matched_within_min_tokens():
    text = OutputText.for_params(CharTokenizer(), [], SamplingParams(stop=["ab"], min_tokens=3))
    assert feed(text, "abxab") == [False, False, False, False, True]
    assert text.text == "abx"  # the earlier "ab" fell within min_tokens


def _first_stop(word: str, stops: list[str], min_tokens: int, include: bool) -> tuple[int, str] | None:
    """Brute force: the first token count k at which the text of k tokens holds a stop string that ends beyond
    the text of min_tokens tokens, and the text then (cut before the earliest such stop, or after it)."""
    for k in range(min_tokens + 1, len(word) + 1):
        text = word[:k]
        found = [(pos, stop) for stop in stops for pos in range(len(text) - len(stop) + 1)
                 if text.startswith(stop, pos) and pos + len(stop) > min_tokens]
        if found:
            pos, stop = min(found)
            return k, text[: pos + len(stop) if include else pos]
    return None


def test_stop_strings_match_a_brute_force_search_searching_only_new_text():
    """Random words over a small alphabet, one or two stop strings, min_tokens and include_stop_str_in_output:
    the step at which match_stop first says True, and the cut text, are those of a search of the whole text
    at every step (match_stop searches only the text that is new since its last search)."""
    rng = random.Random(7)
    for _ in range(400):
        word = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        min_tokens, include = rng.randrange(0, 5), rng.random() < 0.5
        text = OutputText(CharTokenizer(), [], stops, min_tokens, include)
        stopped = feed(text, word)
        want = _first_stop(word, stops, min_tokens, include)
        got = (stopped.index(True) + 1, text.text) if True in stopped else None
        assert got == want, (word, stops, min_tokens, include)


def test_skip_special_tokens_false_keeps_them_in_the_text():
    kept = OutputText.for_params(CharTokenizer(), [], SamplingParams(skip_special_tokens=False))
    skipped = OutputText.for_params(CharTokenizer(), [], SamplingParams())
    for t in (0, 25, 1):
        kept.add(t)
        skipped.add(t)
    assert kept.text == kept.final([0, 25, 1]) == "a<s>b" and skipped.final([0, 25, 1]) == skipped.text == "ab"


@pytest.mark.parametrize("options", [
    dict(num_gpu_blocks=8),  # 4 samples of 5 blocks each do not fit: preemption
    dict(num_gpu_blocks=6, enable_cpu_offload=True, cpu_kv_cache_gb=0.01, max_num_batched_tokens=64),
])
def test_n_greedy_samples_survive_preemption_and_offload(tiny_llama, options):
    prompt = [(11 * i) % 256 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, device="cpu")
    want = reference.generate([prompt], params, use_tqdm=False)[0].token_ids
    engine = LLM(str(tiny_llama), kvcache_block_size=16, device="cpu", **options)
    out = engine.generate([prompt], SamplingParams(temperature=0, n=4, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [want] * 4
    pool = engine.runner.host_pool
    assert engine.scheduler.num_preemptions > 0 if pool is None else pool.stats.d2h_copies > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_host_blocks == 0


def test_fork_prefix_takes_computed_device_prompt_blocks_only():
    from nanovllm.engine.block_manager import HOST_BASE, BlockManager
    from nanovllm.engine.sequence import Sequence

    bm = BlockManager(8, 16)
    parent = Sequence(list(range(50)), SamplingParams(), 16)
    bm.admit(parent, [], 50)
    parent.num_computed_tokens = 50
    assert bm.fork_prefix(parent, 50) == parent.block_table[:3]  # 48 tokens; the 4th block holds token 49
    assert bm.fork_prefix(parent, 48) == parent.block_table[:2]  # never the block of the last prompt token
    parent.num_computed_tokens = 20
    assert bm.fork_prefix(parent, 50) == parent.block_table[:1]
    parent.num_computed_tokens = 50
    parent.block_table[1] = HOST_BASE  # moved to the host pool: not shareable, nor what follows
    assert bm.fork_prefix(parent, 50) == parent.block_table[:1]
