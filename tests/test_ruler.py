"""RULER data and sample generation: invariants of every task at 4K with the SmolLM2 tokenizer, the
sizing search, the harness over a fake engine, and the command line. CPU only, no model weights run."""
from __future__ import annotations

import json
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.niah import DEPTHS
from nanovllm.eval.ruler.tasks import TASK_NAMES, TASKS, _Sizer, Task, generate_samples, generate_task_samples
from nanovllm.eval.ruler.templates import Prompter

LENGTH = 4096
N = 2
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
USER = "<|im_start|>user\n"
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
MAX_NEW = {"vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32} | {
    t: 128 for t in TASK_NAMES if t.startswith("niah")}
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from nanovllm.models.fetch import fetch_model

    return AutoTokenizer.from_pretrained(str(fetch_model("smollm2-135m", progress=False)))


@pytest.fixture(scope="module")
def samples(tokenizer) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in generate_samples(tokenizer, [LENGTH], "all", N, "chat"):
        out.setdefault(s["task"], []).append(s)
    return out


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def user_text(sample: dict) -> str:
    """The task text: between the user header and the assistant header of the chat prompt."""
    prompt = sample["prompt"]
    assert prompt.startswith(SYSTEM + USER)
    assert prompt.endswith(ASSISTANT + sample["answer_prefix"])
    return prompt[len(SYSTEM + USER):-len(ASSISTANT + sample["answer_prefix"])]


# ---- data --------------------------------------------------------------------------------------

def test_data_files_are_verified():
    files = data.ensure_ruler_data()
    expected = {"nounlist.txt", "adjectivelist.txt", "verblist.txt", "squad.json", "hotpotqa.json",
                "PaulGrahamEssays.json"}
    assert set(files) == expected
    digests = {p.split("/")[-1]: h for pkg in data.PACKAGES.values() for p, h in pkg.files.items()}
    for name in ("nounlist.txt", "squad.json"):  # spot-check the recorded sha256s
        assert data.sha256_file(files[name]) == digests[name]


def test_sha256_mismatch_is_refused(monkeypatch):
    pkg = data.PACKAGES["wonderwords"]
    bad = data.DataPackage(pkg.requirement, pkg.module, pkg.no_deps, {"assets/verblist.txt": "0" * 64})
    monkeypatch.setitem(data.PACKAGES, "wonderwords", bad)
    data.ensure_ruler_data.cache_clear()
    try:
        with pytest.raises(ValueError, match="sha256 mismatch"):
            data.ensure_ruler_data()
    finally:
        monkeypatch.undo()
        data.ensure_ruler_data.cache_clear()


def test_word_lists_and_datasets():
    assert len(data.word_list("noun")) == 6786 and data.word_list("noun")[:2] == ("ATM", "CD")
    assert len(data.word_list("adjective")) == 912 and len(data.word_list("verb")) == 1042
    adjectives, nouns = data.key_parts()
    assert list(adjectives) == sorted(set(adjectives)) and len(nouns) == len(set(data.word_list("noun")))
    assert len(data.common_vocabulary()) == len(set(data.word_list("noun") + data.word_list("adjective")
                                                    + data.word_list("verb")))
    words = data.essay_words()
    assert len(words) > 500_000 and words[:3] == ("April", "2012A", "palliative")
    squad = data.squad()
    assert squad.items[0].query == "In what country is Normandy located?"
    assert squad.items[0].answers[0] == "France"
    assert all(squad.documents[i] for i in squad.items[0].gold + squad.items[0].related)
    assert len(squad.items) == 5928  # answerable questions of SQuAD v2 dev
    hotpot = data.hotpotqa()
    assert len(hotpot.items) == 7405 and hotpot.items[0].answers == ("yes",)
    assert len(hotpot.items[0].gold) == 10 and hotpot.documents[hotpot.items[0].gold[0]].count("\n") >= 1


def test_punkt_sentence_splitting():
    assert data.sent_tokenize("Dr. Smith went home. He was tired.") == ["Dr. Smith went home.", "He was tired."]
    assert data.sent_tokenize("It cost $5.50 at 3 p.m. today. Then we left!") == [
        "It cost $5.50 at 3 p.m. today.", "Then we left!"]


# ---- every task at 4K --------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASK_NAMES)
def test_samples_fit_the_budget(task, samples, tokenizer):
    got = samples[task]
    assert [s["index"] for s in got] == list(range(N))
    for s in got:
        assert set(s) >= {"index", "task", "length", "prompt", "references", "max_new_tokens"}
        assert s["task"] == task and s["length"] == LENGTH and s["max_new_tokens"] == MAX_NEW[task]
        assert s["references"] and all(isinstance(r, str) and r for r in s["references"])
        n = count(tokenizer, s["prompt"])
        assert n == s["prompt_tokens"]
        assert n + s["max_new_tokens"] <= LENGTH
        assert n > LENGTH // 2, f"{task} uses only {n} of {LENGTH} tokens"
        assert s["answer_prefix"].startswith(" ")


@pytest.mark.parametrize("task", [t for t in TASK_NAMES if t.startswith("niah")])
def test_niah_needles(task, samples):
    value_type = "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"
    for s in samples[task]:
        text = user_text(s)
        question = text.rsplit("\n", 1)[1]
        query = re.fullmatch(r"What (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\?",
                             question).group(1)
        keys = query.replace(", and ", ", ").split(", ")
        needles = re.findall(rf"One of the special magic {value_type} for (.+?) is: (\S+)\.", text)
        for ref in s["references"]:
            assert sum(value == ref for _, value in needles) == 1, ref
        assert all(k in keys for k, v in needles if v in s["references"])
        expected_needles = {"niah_multikey_1": 4, "niah_multivalue": 4, "niah_multiquery": 4}.get(task, 1)
        if task in ("niah_multikey_2", "niah_multikey_3"):  # every haystack line is a needle
            assert len(needles) == len(text.split("\n")) - 2
            assert sum(k in keys for k, _ in needles) == 1
        else:
            assert len(needles) == expected_needles
        assert len(s["references"]) == (4 if task in ("niah_multivalue", "niah_multiquery") else 1)
        assert len(keys) == (4 if task == "niah_multiquery" else 1)
        context = text.split("\n", 1)[1].rsplit("\n", 1)[0]
        first = f"for {next(k for k, v in needles if v == s['references'][0])} is: {s['references'][0]}."
        where = context.index(first) / len(context) * 100
        assert 0 <= s["depth"] <= 100 and abs(where - s["depth"]) < 8, (where, s["depth"])
        if task not in ("niah_single_1", "niah_multikey_2", "niah_multikey_3"):
            assert all(d in DEPTHS for d in s["depths"])
            assert "The grass is green" not in context


def test_vt_chain(samples):
    for s in samples["vt"]:
        text = user_text(s)
        example, task_text = text.split("\n\n" + "Memorize and track", 1)
        assert example.startswith("Memorize and track the chain(s) of variable assignment hidden in the following")
        names = s["references"]
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        lines = task_text.split("\n")
        value = re.fullmatch(r"VAR (\w+) = (\d+)", next(x for x in lines if x.startswith(f"VAR {names[0]} = ")))
        assert value and 10000 <= int(value.group(2)) <= 99999
        chain = [lines.index(f"VAR {names[0]} = {value.group(2)}")]
        chain += [lines.index(f"VAR {names[i + 1]} = VAR {names[i]}") for i in range(4)]
        assert chain == sorted(chain)
        assert all(x == NOISE or x.startswith("VAR") for x in lines[2:-1])
        assert task_text.endswith(f"Question: Find all variables that are assigned the value {value.group(2)} "
                                  "in the text above.")
        assert s["answer_prefix"] == (" Answer: According to the chain(s) of variable assignment in the text "
                                      f"above, 5 variables are assigned the value {value.group(2)}, they are: ")
        assert example.count(" they are: ") == 1  # the one-shot example carries its answer


def _numbered(text: str) -> list[str]:
    return re.findall(r"\d+\. (.+?)(?= \d+\. |$)", text)


def test_cwe_counts(samples):
    for s in samples["cwe"]:
        text = user_text(s)
        head = "Below is a numbered list of words. In these words, some appear more often than others. " \
               "Memorize the ones that appear most often.\n"
        assert text.startswith(head) and text.count(head) == 2
        real = text.split(head)[2]
        listing, question = real.split("\n")
        assert question == "Question: What are the 10 most common words in the above list?"
        entries = _numbered(listing)
        numbers = [int(n) for n in re.findall(r"(?:^| )(\d+)\. ", listing)]
        assert numbers == list(range(1, len(entries) + 1))
        counts = Counter(entries)
        assert len(s["references"]) == 10
        assert all(counts[w] == 30 for w in s["references"])
        assert all(c == 3 for w, c in counts.items() if w not in s["references"])
        example_answer = text.split(head)[1].split(s["answer_prefix"] + " ")[1].split("\n")[0]
        assert len(_numbered(example_answer)) == 10
        assert s["answer_prefix"] == " Answer: The top 10 words that appear most often in the list are:"


def test_fwe_frequencies(samples):
    for s in samples["fwe"]:
        text = user_text(s)
        head = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. ")
        tail = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
        assert text.startswith(head) and text.endswith(tail)
        ranked = Counter(text[len(head):-len(tail)].split(" ")).most_common()
        assert ranked[0][0] == "..."
        assert [w for w, _ in ranked[1:4]] == s["references"]
        assert ranked[1][1] > ranked[2][1] > ranked[3][1] > ranked[4][1]
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in s["references"])
        assert s["answer_prefix"] == (" Answer: According to the coded text above, the three most frequently "
                                      "appeared words are:")


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_documents(task, samples):
    qa = data.squad() if task == "qa_1" else data.hotpotqa()
    instruction = "Answer the question based on the given documents. Only give me the answer and do not output " \
                  "any other words."
    for s in samples[task]:
        item = qa.items[s["index"]]  # file order
        text = user_text(s)
        assert text.startswith(instruction + "\n\nThe following are given documents.\n\nDocument 1:\n")
        assert text.endswith(f"\n\n{instruction}\n\nQuestion: {item.query}")
        assert s["references"] == list(item.answers) and s["answer_prefix"] == " Answer:"
        docs = re.split(r"\n\nDocument \d+:\n", text.split("Document 1:\n", 1)[1].rsplit(f"\n\n{instruction}", 1)[0])
        assert len(docs) == s["filler_units"] == len(set(docs))
        assert all(qa.documents[g] in docs for g in item.gold)
        if task == "qa_1":
            assert any(a in text for a in s["references"])


def test_deterministic_for_a_seed(tokenizer):
    prompter = Prompter(tokenizer, "chat")
    for task in ("niah_multikey_1", "fwe", "qa_2"):
        a = generate_task_samples(task, LENGTH, 2, prompter, seed=42)
        assert a == generate_task_samples(task, LENGTH, 2, prompter, seed=42)
        assert a[0]["prompt"] != generate_task_samples(task, LENGTH, 1, prompter, seed=7)[0]["prompt"]


def test_base_template_and_singular_wording(tokenizer):
    s = generate_task_samples("niah_single_1", LENGTH, 1, Prompter(tokenizer, "base"))[0]
    prompt = s["prompt"]
    assert "<|im_start|>" not in prompt
    assert prompt.startswith("A special magic number is hidden within the following text. Make sure to memorize "
                             "it. I will quiz you about the number afterwards.\n" + NOISE + "\n")
    key = re.search(r"What is the special magic number for (\S+) mentioned in the provided text\?", prompt).group(1)
    assert prompt.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text?"
                           f" The special magic number for {key} mentioned in the provided text is")
    assert count(tokenizer, prompt) + 128 <= LENGTH


def test_plural_wording(samples):
    s = samples["niah_multivalue"][0]
    text = user_text(s)
    key = re.search(r"for (\S+) mentioned in the provided text\?$", text).group(1)
    assert text.startswith("Some special magic numbers are hidden within the following text. Make sure to memorize "
                           "it. I will quiz you about the numbers afterwards.\n")
    assert text.endswith(f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?")
    assert s["answer_prefix"] == f" The special magic numbers for {key} mentioned in the provided text are"
    q = samples["niah_multiquery"][0]
    assert re.search(r"for \S+, \S+, \S+, and \S+ mentioned in the provided text\?$", user_text(q))


def test_chat_template_is_the_tokenizers(tokenizer, samples):
    s = samples["qa_1"][0]
    wrapped = tokenizer.apply_chat_template([{"role": "user", "content": user_text(s)}], add_generation_prompt=True,
                                            tokenize=False)
    assert s["prompt"] == wrapped + s["answer_prefix"]


def test_chat_template_required():
    with pytest.raises(ValueError, match="no chat template"):
        Prompter(SimpleNamespace(chat_template=None), "chat")
    with pytest.raises(ValueError, match="template must be"):
        Prompter(SimpleNamespace(chat_template="x"), "llama")


# ---- sizing ------------------------------------------------------------------------------------

class WordTokenizer:
    """One token per space-separated word."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [0] * len(text.split())}


@pytest.mark.parametrize("length,per_unit,overhead", [(4096, 1, 10), (4096, 3, 700), (131072, 2, 5000)])
def test_sizing_finds_the_largest_fit(length, per_unit, overhead):
    from nanovllm.eval.ruler.common import Draft

    def make(rng, units, index, length):
        return Draft("w " * (units * per_unit + overhead), "", ["w"])

    task = Task("fake", 30, "all", make, lambda length: 10)
    import random

    best = _Sizer(task, length, Prompter(WordTokenizer(), "base"), random.Random(0)).largest_fitting()
    assert best == (length - 30 - overhead) // per_unit // 10 * 10  # a multiple of the increment, as RULER's


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown RULER task"):
        generate_samples(WordTokenizer(), [LENGTH], ["nope"], 1, "base")


# ---- the harness over a fake engine ------------------------------------------------------------

class FakeLLM:
    """Answers every prompt with its references (an oracle), counting generate() calls."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], str]):
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(max_model_len=LENGTH + 256, model="/models/fake", model_path="/models/fake")
        self.answers = answers
        self.calls = []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        outs = []
        for ids, p in zip(prompts, params):
            text = self.answers[tuple(ids)]
            metrics = SimpleNamespace(prefill_density=0.5 if len(outs) % 2 else 0.25, decode_density=1.0,
                                      host_kv_bytes_read=10**8)
            outs.append(SimpleNamespace(text=text, token_ids=[1] * min(len(text.split()), p.max_tokens),
                                        finish_reason="stop", metrics=metrics))
        return outs


def test_run_ruler_over_a_fake_engine(tokenizer, samples, tmp_path, capsys):
    from nanovllm.eval.ruler.run import run_ruler

    tasks = ["niah_multivalue", "vt", "qa_2"]
    prompter = Prompter(tokenizer, "chat")
    answers = {}
    for task in tasks:
        for i, s in enumerate(samples[task]):  # the first sample right, the second one wrong
            answers[tuple(prompter.encode(s["prompt"]))] = " " + ", ".join(s["references"]) if i == 0 else " ???"
    llm = FakeLLM(tokenizer, answers)
    result = run_ruler(llm, [LENGTH], tasks, N, tmp_path, template="chat", use_tqdm=False, generator="ours")

    assert len(llm.calls) == 1  # one batch for everything
    prompts, params = llm.calls[0]
    assert len(prompts) == 3 * N and all(isinstance(p, list) and isinstance(p[0], int) for p in prompts)
    assert [p.max_tokens for p in params] == [128] * N + [30] * N + [32] * N
    assert all(p.temperature == 0 for p in params)
    summary = result["summary"]
    for task in tasks:
        assert summary["tasks"][task][LENGTH] == {"score": 50.0, "passed": 1, "total": 2}
    assert summary["lengths"][LENGTH] == {"score": 50.0, "passed": 3, "total": 6}
    saved = json.loads((tmp_path / "ruler.json").read_text())
    assert saved["config"]["tasks"] == tasks and len(saved["samples"]) == 6
    assert saved["config"]["generator"] == "ours"
    first = saved["samples"][0]
    assert first["prompt"] == samples["niah_multivalue"][0]["prompt"] and first["score"] == 100.0
    assert first["prediction"].startswith(" ") and first["references"] == samples["niah_multivalue"][0]["references"]
    assert saved["timings"]["samples_per_s"] > 0
    assert (tmp_path / "ruler.md").read_text().count("| vt | 50.00 (1/2) |") == 1
    out = capsys.readouterr().out
    assert "| **average** | **50.00 (3/6)** |" in out and "samples/s" in out
    assert saved["attention"] == {str(LENGTH): {"prefill_density": 0.375, "decode_density": 1.0, "host_kv_gb": 0.6}}
    assert "prefill density 0.375, decode density 1.000, host KV read 0.60 GB" in (tmp_path / "ruler.md").read_text()
    if "chart" in result["files"]:
        assert (tmp_path / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_ruler_reports_prompts_over_their_budget(tokenizer, samples, tmp_path, capsys):
    """RULER's own fwe script can leave fewer than max_new_tokens: such samples run, with a warning."""
    from nanovllm.eval.ruler.run import run_ruler, save_samples

    s = {**samples["fwe"][0], "max_new_tokens": LENGTH - samples["fwe"][0]["prompt_tokens"] + 1}
    save_samples([s], tmp_path / "s.json.gz")
    llm = FakeLLM(tokenizer, {tuple(Prompter(tokenizer, "chat").encode(s["prompt"])): " x"})
    result = run_ruler(llm, [LENGTH], ["fwe"], 1, tmp_path, use_tqdm=False, samples_file=tmp_path / "s.json.gz")
    assert len(result["records"]) == 1
    assert "1 prompts leave fewer than max_new_tokens before their length: fwe@4096#0" in capsys.readouterr().err


def test_run_ruler_refuses_lengths_over_max_model_len(tokenizer, tmp_path):
    from nanovllm.eval.ruler.run import run_ruler

    with pytest.raises(ValueError, match="max_model_len"):
        run_ruler(FakeLLM(tokenizer, {}), [8192], ["vt"], 1, tmp_path)


# ---- command line ------------------------------------------------------------------------------

def test_cli_arguments():
    import argparse

    from nanovllm.engine_args import engine_options
    from nanovllm.eval.ruler.run import add_ruler_parser, build_parser, cmd_ruler

    args = build_parser().parse_args(["--model", "m", "--lengths", "4k", "8192", "--tasks", "vt", "qa_1",
                                      "--samples", "3", "--output", "o", "--template", "base", "--device", "cpu",
                                      "--max-model-len", "8448"])
    assert (args.model, args.lengths, args.tasks, args.samples, args.output, args.template) == \
        ("m", [4096, 8192], ["vt", "qa_1"], 3, "o", "base")
    assert engine_options(args) == {"device": "cpu", "max_model_len": 8448}
    defaults = build_parser().parse_args([])
    assert (defaults.lengths, defaults.tasks, defaults.template, defaults.data_seed, defaults.generator) == \
        ([4096], ["all"], "chat", 42, "official")
    assert build_parser().parse_args(["--generator", "ours"]).generator == "ours"

    top = argparse.ArgumentParser(prog="nanovllm")
    sub = top.add_subparsers(dest="command", required=True)
    add_ruler_parser(sub)
    args = top.parse_args(["ruler", "--samples", "2", "--tasks", "all"])
    assert args.func is cmd_ruler and args.samples == 2


def test_cli_rejects_unknown_task_before_loading(capsys):
    from nanovllm.eval.ruler.run import main

    with pytest.raises(SystemExit) as e:
        main(["--tasks", "niah_single_9", "--model", "/nonexistent"])
    assert e.value.code == 2 and "unknown RULER task" in capsys.readouterr().err


def test_task_table():
    assert len(TASK_NAMES) == 13
    assert {t: TASKS[t].max_new_tokens for t in TASK_NAMES} == MAX_NEW
    assert {t for t in TASK_NAMES if TASKS[t].metric == "part"} == {"qa_1", "qa_2"}


def test_first_samples_of_a_samples_file():
    from nanovllm.eval.ruler.run import first_samples

    samples = [{"task": t, "length": n, "i": i} for i in range(3) for t in ("vt", "cwe") for n in (4096, 8192)]
    kept = first_samples(samples, ["vt"], [4096, 8192], 2)
    assert [(s["length"], s["i"]) for s in kept] == [(4096, 0), (8192, 0), (4096, 1), (8192, 1)]


def test_samples_file_without_the_requested_lengths_is_refused_before_loading(tokenizer, tmp_path, capsys):
    from nanovllm.eval.ruler.run import main, run_ruler, save_samples

    path = tmp_path / "samples.json.gz"
    save_samples([{"task": t, "length": n} for t in ("vt", "cwe") for n in (32768, 16384)], path)
    with pytest.raises(SystemExit) as e:
        main(["--samples-file", str(path), "--model", "/nonexistent"])  # default --lengths 4096 --tasks all
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no sample in" in err and "--lengths 4096" in err
    assert "the file holds lengths 16384 32768 and tasks vt cwe" in err
    with pytest.raises(ValueError, match="holds lengths 16384 32768 and tasks vt cwe"):
        run_ruler(FakeLLM(tokenizer, {}), [4096], ["qa_1"], 1, tmp_path, samples_file=path)
