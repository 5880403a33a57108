"""Needle in a haystack (nanovllm.eval.needle): prompt sizing and needle depth with the SmolLM2 tokenizer,
the sweep over a fake engine (one generate call, grid, JSON, Markdown, PNG), and the command line.
CPU only; the one slow test runs SmolLM2-135M for real."""
from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import pytest

from nanovllm.eval import needle as nd
from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.common import NOISE
from nanovllm.eval.ruler.templates import Prompter

PAIRS = [(1024, 0.0), (1024, 30.0), (1536, 50.0), (1536, 90.0), (2048, 10.0), (2048, 100.0)]
INTRO = "I will quiz you about the number afterwards.\n"
QUESTION = "\nWhat is the special magic number for "


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from nanovllm.models.fetch import fetch_model

    return AutoTokenizer.from_pretrained(str(fetch_model("smollm2-135m", progress=False)))


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


@pytest.fixture(scope="module", params=nd.HAYSTACKS)
def built(request, tokenizer) -> tuple[str, list[dict]]:
    haystack = request.param
    out = []
    for length, depth in PAIRS:
        out += nd.build_needle_prompts(tokenizer, [length], [depth], haystack, samples_per_cell=1)
    return haystack, out


def split_prompt(s: dict) -> tuple[int, int, int]:
    """(haystack start, needle start, haystack end) character offsets in the prompt, found independently."""
    prompt = s["prompt"]
    assert prompt.count(s["needle"]) == 1 and prompt.count(INTRO) == 1 and prompt.count(QUESTION) == 1
    return prompt.index(INTRO) + len(INTRO), prompt.index(s["needle"]), prompt.index(QUESTION)


# ---- prompts ------------------------------------------------------------------------------------

def test_prompts_fit_the_budget(built, tokenizer):
    haystack, samples = built
    prompter = Prompter(tokenizer, "chat")
    for s in samples:
        length = s["length"]
        n = count(tokenizer, s["prompt"])
        assert s["token_ids"] == prompter.encode(s["prompt"]) and n == s["prompt_tokens"] == len(s["token_ids"])
        assert n + nd.MAX_NEW_TOKENS <= length and s["max_new_tokens"] == nd.MAX_NEW_TOKENS == 32
        # the haystack is the largest that fits: one more unit (word / line) breaks the budget
        bigger = nd.render_prompt(prompter, haystack, s["units"] + 1, s["depth"], nd.Needle(s["key"], s["reference"]))
        assert count(tokenizer, bigger["prompt"]) + nd.MAX_NEW_TOKENS > length
        assert length - nd.MAX_NEW_TOKENS - n < (4 if haystack == "essay" else 25), "the budget is not filled"
        assert s["prompt"].endswith(" The special magic number for " + s["key"] + " mentioned in the provided text is")
        assert s["prompt"].startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in s["prompt"]
        assert s["needle"] == f"One of the special magic numbers for {s['key']} is: {s['reference']}."
        assert len(s["reference"]) == 7 and s["reference"].isdigit() and "-" in s["key"]


def test_needle_at_the_requested_depth(built, tokenizer):
    haystack, samples = built
    for s in samples:
        start, at, end = split_prompt(s)
        hay_chars = end - start - len(s["needle"]) - 1  # without the needle and its separator
        char_depth = 100 * (at - start) / hay_chars
        before = count(tokenizer, s["prompt"][:at]) - count(tokenizer, s["prompt"][:start])
        hay_tokens = count(tokenizer, s["prompt"][:end]) - count(tokenizer, s["prompt"][:start]) - count(
            tokenizer, " " + s["needle"])
        token_depth = 100 * before / hay_tokens
        tol = 4.0 if s["length"] == 1024 else 3.0  # one sentence / line is a few % of a 1K haystack
        assert abs(char_depth - s["depth"]) <= tol, (s["length"], s["depth"], char_depth)
        assert abs(token_depth - s["depth"]) <= tol + 0.5, (s["length"], s["depth"], token_depth)
        assert abs(s["depth_chars"] - char_depth) < 0.2 and abs(s["depth_tokens"] - token_depth) < 1.0
        if s["depth"] == 0:
            assert at == start
        if s["depth"] == 100:
            assert at + len(s["needle"]) == end


def test_needle_sits_on_a_unit_boundary(built):
    haystack, samples = built
    for s in samples:
        start, _, end = split_prompt(s)
        context = s["prompt"][start:end]
        pieces = nd.haystack_units(haystack, s["units"])
        sep = " " if haystack == "essay" else "\n"
        assert context in [sep.join(pieces[:b] + [s["needle"]] + pieces[b:]) for b in range(len(pieces) + 1)]
        if haystack == "noise":
            lines = context.split("\n")
            assert len(lines) == s["units"] + 1 and lines.count(NOISE) == s["units"]


def test_essay_haystack_is_the_first_words():
    words = data.essay_words()
    sentences, cum = nd._essay()  # punkt sentences of the whole essay text
    essay = " ".join(sentences).split()  # the essay words, except punkt splits a few (e.g. 'startup."What')
    for n in (0, 1, 37, 1000, 4321):
        text = " ".join(nd.essay_sentences(n))
        assert text.split() == essay[:n]
        assert "".join(words).startswith("".join(text.split()))  # the essay's text, re-spaced
    total = cum[-1]
    assert nd.essay_sentences(total + 5)[:len(sentences)] == list(sentences)  # repeats past the end
    assert " ".join(nd.essay_sentences(total + 5)).split()[total:] == " ".join(sentences).split()[:5]


def test_insert_at_depth():
    pieces = ["aaaa", "bbbb", "cccc", "dddd"]  # offsets of the boundaries: 0, 4, 9, 14, 19
    assert nd.insert_at_depth(pieces, " ", 0, "N") == ("N aaaa bbbb cccc dddd", 0, 19)
    assert nd.insert_at_depth(pieces, " ", 100, "N") == ("aaaa bbbb cccc dddd N", 19, 19)
    assert nd.insert_at_depth(pieces, " ", 50, "N")[0] == "aaaa bbbb N cccc dddd"
    assert nd.insert_at_depth(pieces, " ", 70, "N")[0] == "aaaa bbbb cccc N dddd"
    assert nd.insert_at_depth([], "\n", 50, "N") == ("N", 0, 0)


def test_deterministic_for_a_seed(tokenizer):
    args = (tokenizer, [1024], [0, 60], "essay", 2)
    first, again = nd.build_needle_prompts(*args, seed=7), nd.build_needle_prompts(*args, seed=7)
    assert first == again
    other = nd.build_needle_prompts(*args, seed=8)
    assert [s["reference"] for s in other] != [s["reference"] for s in first]
    # sample i carries the same needle in every cell; the two samples differ
    assert first[0]["key"] == first[2]["key"] != first[1]["key"] == first[3]["key"]
    assert nd.draw_needles(3, 7)[:2] == nd.draw_needles(2, 7)


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="too short"):
        nd.build_needle_prompts(tokenizer, [100], [50])
    with pytest.raises(ValueError, match="depths are percentages"):
        nd.build_needle_prompts(tokenizer, [1024], [-1, 50])
    with pytest.raises(ValueError, match="duplicate lengths"):
        nd.build_needle_prompts(tokenizer, [1024, "1k"], [50])
    with pytest.raises(ValueError, match="haystack"):
        nd.build_needle_prompts(tokenizer, [1024], [50], haystack="needle")


# ---- the sweep over a fake engine ---------------------------------------------------------------

class FakeLLM:
    """Canned answers by prompt token ids; counts generate() calls."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], str], max_model_len: int = 4096):
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(max_model_len=max_model_len, model="/models/fake-model")
        self.answers = answers
        self.calls = []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        return [SimpleNamespace(text=self.answers[tuple(ids)], token_ids=[1] * 5, finish_reason="stop")
                for ids in prompts]


LENGTHS, DEPTHS = [1024, 2048], [0.0, 50.0, 100.0]


def canned(tokenizer, haystack="essay", seed=42) -> tuple[dict, dict]:
    """Answers: sample 0 always right; sample 1 right only at 1K and depth < 100. Plus the expected grid."""
    answers, expected = {}, {}
    for s in nd.build_needle_prompts(tokenizer, LENGTHS, DEPTHS, haystack, 2, seed=seed):
        right = s["sample"] == 0 or (s["length"] == 1024 and s["depth"] < 100)
        answers[tuple(s["token_ids"])] = f": {s['reference']}." if right else ": 1234567, I think.\n"
        expected.setdefault((s["depth"], s["length"]), []).append(100.0 if right else 0.0)
    return answers, expected


def test_run_needle_over_a_fake_engine(tokenizer, tmp_path, capsys):
    answers, expected = canned(tokenizer)
    llm = FakeLLM(tokenizer, answers)
    result = nd.run_needle(llm, ["1k", 2048], DEPTHS, tmp_path, samples_per_cell=2, use_tqdm=False)

    assert len(llm.calls) == 1  # every prompt in one generate() call
    prompts, params = llm.calls[0]
    assert len(prompts) == 12 and all(isinstance(p, list) and isinstance(p[0], int) for p in prompts)
    assert params.temperature == 0 and params.max_tokens == 32

    summary = result["summary"]
    assert summary["lengths"] == LENGTHS and summary["depths"] == DEPTHS
    assert summary["scores"] == [[sum(expected[(d, n)]) / 2 for n in LENGTHS] for d in DEPTHS]
    assert summary["scores"] == [[100.0, 50.0], [100.0, 50.0], [50.0, 50.0]]
    assert summary["length_means"] == [round(500 / 6, 2), 50.0] and summary["overall"] == round(800 / 12, 2)
    assert (summary["passed"], summary["total"]) == (8, 12)

    saved = json.loads((tmp_path / "needle.json").read_text())
    assert saved["config"]["lengths"] == LENGTHS and saved["config"]["max_new_tokens"] == 32
    assert saved["summary"] == summary and len(saved["records"]) == 12
    for r in saved["records"]:
        assert {"length", "depth", "sample", "prediction", "reference", "score", "depth_tokens"} <= set(r)
        assert r["score"] == (100.0 if r["reference"] in r["prediction"] else 0.0)
    assert [(r["length"], r["depth"], r["sample"]) for r in saved["records"]] == [
        (n, d, i) for n in LENGTHS for d in DEPTHS for i in range(2)]

    out = capsys.readouterr().out
    table = result["markdown"]
    assert table in out and table in (tmp_path / "needle.md").read_text()
    assert "| depth \\ length | 1K | 2K |" in table
    assert "| 0% | 100 | 50 |" in table and "| 100% | 50 | 50 |" in table
    assert "| **mean** | **83.3** | **50** |" in table
    assert (tmp_path / "needle.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["files"]["heatmap"] == str(tmp_path / "needle.png")


def test_heatmap_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    summary = {"lengths": [1024], "depths": [0.0], "scores": [[100.0]], "length_means": [100.0]}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.warns(UserWarning, match="matplotlib"):
        assert nd.save_heatmap(summary, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_run_needle_refuses_lengths_over_max_model_len(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="max_model_len"):
        nd.run_needle(FakeLLM(tokenizer, {}, max_model_len=1024), [2048], [50], tmp_path)


# ---- command line -------------------------------------------------------------------------------

def test_cli_arguments():
    from nanovllm.engine_args import engine_options

    args = nd.build_parser().parse_args([
        "--model", "m", "--lengths", "1k", "2048", "4K", "--depths", "0", "33.3", "100", "--samples-per-cell", "2",
        "--haystack", "noise", "--template", "base", "--output", "o", "--data-seed", "7", "--device", "cpu"])
    assert (args.model, args.lengths, args.depths, args.samples_per_cell, args.haystack, args.template, args.output,
            args.data_seed) == ("m", [1024, 2048, 4096], [0.0, 33.3, 100.0], 2, "noise", "base", "o", 7)
    assert engine_options(args) == {"device": "cpu"}
    defaults = nd.build_parser().parse_args([])
    assert defaults.depths == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
    assert (defaults.lengths, defaults.haystack, defaults.template, defaults.samples_per_cell, defaults.data_seed) \
        == ([1024, 2048, 4096, 8192], "essay", "chat", 1, 42)
    with pytest.raises(SystemExit):
        nd.build_parser().parse_args(["--lengths", "4q"])

    for action in nd.build_parser()._actions:  # every option documents itself
        assert action.help, action.option_strings

    from nanovllm.cli import build_parser

    args = build_parser().parse_args(["needle", "--lengths", "8k", "--depths", "50"])
    assert args.func is nd.cmd_needle and args.lengths == [8192] and args.depths == [50.0]
    top = argparse.ArgumentParser(prog="nanovllm")
    nd.add_needle_parser(top.add_subparsers(dest="command", required=True))
    assert top.parse_args(["needle"]).func is nd.cmd_needle


def test_cli_runs_over_a_fake_engine(tokenizer, tmp_path, monkeypatch, capsys):
    import nanovllm

    answers, _ = canned(tokenizer, "noise", seed=3)
    made = []

    def fake_llm(model, **options):
        made.append((model, options))
        return FakeLLM(tokenizer, answers, options["max_model_len"])

    monkeypatch.setattr(nanovllm, "LLM", fake_llm)
    nd.main(["--model", "m", "--lengths", "1k", "2k", "--depths", "0", "50", "100", "--samples-per-cell", "2",
             "--haystack", "noise", "--data-seed", "3", "--output", str(tmp_path), "--device", "cpu", "--no-progress"])
    assert made == [("m", {"device": "cpu", "max_model_len": 2048})]  # max_model_len defaults to the largest length
    saved = json.loads((tmp_path / "needle.json").read_text())
    assert saved["config"]["haystack"] == "noise" and saved["summary"]["scores"] == [[100.0, 50.0]] * 2 + [[50.0, 50.0]]
    assert "| 50% | 100 | 50 |" in capsys.readouterr().out


def test_cli_rejects_bad_depths_before_loading(capsys, monkeypatch):
    import nanovllm

    monkeypatch.setattr(nanovllm, "LLM", lambda *a, **k: pytest.fail("the model must not be loaded"))
    with pytest.raises(SystemExit) as e:
        nd.main(["--depths", "0", "150", "--model", "/nonexistent"])
    assert e.value.code == 2 and "depths are percentages" in capsys.readouterr().err


# ---- end to end ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_needle_end_to_end_smollm2(tmp_path):
    from nanovllm import LLM
    from nanovllm.models.fetch import fetch_model

    llm = LLM(str(fetch_model("smollm2-135m", progress=False)), max_model_len=1024, device="cpu")
    result = nd.run_needle(llm, [1024], [0, 50, 100], tmp_path, use_tqdm=False)
    records = result["records"]
    assert [(r["length"], r["depth"]) for r in records] == [(1024, 0.0), (1024, 50.0), (1024, 100.0)]
    for r in records:
        assert r["score"] in (0.0, 100.0) and r["prompt_tokens"] + 32 <= 1024
        assert 0 < r["output_tokens"] <= 32 and r["finish_reason"] in ("stop", "length")
        print(f"depth {r['depth']:g}%: score {r['score']:g}, prediction {r['prediction']!r}, "
              f"reference {r['reference']}")
    assert (tmp_path / "needle.json").exists() and (tmp_path / "needle.md").exists()
    assert (tmp_path / "needle.png").exists()
