"""RULER's 13 default tasks and the sample generator with its filler sizing.

Sizing: for each (task, length), search for the largest multiple of the task's filler increment whose
full prompt (wrapper + task text + answer prefix) satisfies ``tokens(prompt) + max_new_tokens <= length``,
then for each sample step down by the increment until that sample fits. One ``random.Random(seed)`` drives each (task, length).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.common import Draft
from nanovllm.eval.ruler.niah import NiahSpec, make_niah
from nanovllm.eval.ruler.qa import make_qa
from nanovllm.eval.ruler.synthetic import make_cwe, make_fwe, make_vt
from nanovllm.eval.ruler.templates import Prompter

DEFAULT_SEED = 42
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)

# make(rng, units, sample index, length) -> Draft
MakeFn = Callable[[random.Random, int, int, int], Draft]


@dataclass(frozen=True)
class Task:
    name: str
    max_new_tokens: int
    metric: str  # "all" (string_match_all) or "part" (string_match_part)
    make: MakeFn
    increment: Callable[[int], int]  # filler units per sizing step, by length
    max_units: Callable[[], int | None] = lambda: None


def _niah(name: str, spec: NiahSpec) -> Task:
    return Task(name, 128, "all", lambda rng, units, index, length: make_niah(spec, rng, units),
                spec.increment_for, spec.max_units)


TASKS: dict[str, Task] = {t.name: t for t in (
    _niah("niah_single_1", NiahSpec("noise", "words", "numbers")),
    _niah("niah_single_2", NiahSpec("essay", "words", "numbers")),
    _niah("niah_single_3", NiahSpec("essay", "words", "uuids")),
    _niah("niah_multikey_1", NiahSpec("essay", "words", "numbers", num_keys=4)),
    _niah("niah_multikey_2", NiahSpec("needle", "words", "numbers")),
    _niah("niah_multikey_3", NiahSpec("needle", "uuids", "uuids")),
    _niah("niah_multivalue", NiahSpec("essay", "words", "numbers", num_values=4)),
    _niah("niah_multiquery", NiahSpec("essay", "words", "numbers", num_keys=4, num_queries=4)),
    Task("vt", 30, "all", lambda rng, units, index, length: make_vt(rng, units),
         lambda length: 5 if length < 4096 else 10),
    Task("cwe", 120, "all", lambda rng, units, index, length: make_cwe(rng, units, length),
         lambda length: 10, lambda: len(data.common_vocabulary())),
    Task("fwe", 50, "all", lambda rng, units, index, length: make_fwe(rng, units, length), lambda length: 10),
    Task("qa_1", 32, "part", lambda rng, units, index, length: make_qa("squad", rng, units, index),
         lambda length: 10, lambda: len(data.squad().documents)),
    Task("qa_2", 32, "part", lambda rng, units, index, length: make_qa("hotpotqa", rng, units, index),
         lambda length: 10, lambda: len(data.hotpotqa().documents)),
)}
TASK_NAMES = tuple(TASKS)


def resolve_tasks(tasks: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """"all"/None -> the 13 default tasks; otherwise validated names in the given order."""
    if tasks is None or tasks == "all" or list(tasks) == ["all"]:
        return list(TASK_NAMES)
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; known: {', '.join(TASK_NAMES)}")
    return names


class _Sizer:
    def __init__(self, task: Task, length: int, prompter: Prompter, rng: random.Random):
        self.task, self.length, self.prompter, self.rng = task, length, prompter, rng
        self.budget = length - task.max_new_tokens  # prompt tokens allowed

    def try_units(self, units: int, index: int = 0) -> tuple[Draft, str, int]:
        draft = self.task.make(self.rng, units, index, self.length)
        prompt = self.prompter.build(draft.task_text, draft.answer_prefix)
        return draft, prompt, self.prompter.count(prompt)

    def fits(self, units: int) -> bool:
        return self.try_units(units)[2] <= self.budget

    def largest_fitting(self) -> int:
        """The largest multiple of the task's increment (capped at max_units) whose probe instance fits.

        RULER's scripts step up one increment at a time until the probe no longer fits, so their filler is
        always a multiple of the increment; a finer search fills up to one increment more (for qa_1 and
        niah_multikey_3 at 4K, over 30% more tokens). We bisect over the same multiples.
        """
        inc = self.task.increment(self.length)
        cap = self.task.max_units()
        k_max = None if cap is None else -(-cap // inc)

        def units(k: int) -> int:
            return k * inc if cap is None else min(k * inc, cap)

        _, _, tokens = self.try_units(inc)
        if tokens > self.budget:
            raise ValueError(f"{self.task.name}: even {inc} filler units take {tokens} tokens, over the "
                             f"{self.budget}-token prompt budget of length {self.length}")
        lo, hi = 1, max(int(self.length / tokens * 3), 2)  # in increments
        if k_max is not None:
            hi = min(hi, k_max)
        while (k_max is None or hi < k_max) and self.fits(units(hi)):  # the estimate was too low: widen
            lo, hi = hi, hi * 2 if k_max is None else min(hi * 2, k_max)
        best = lo
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.fits(units(mid)):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return units(best)


def generate_task_samples(task: str, length: int, num_samples: int, prompter: Prompter,
                          seed: int = DEFAULT_SEED) -> list[dict]:
    """``num_samples`` samples of one task at one length (``length`` = max_seq_length in tokens)."""
    spec = TASKS[task]
    sizer = _Sizer(spec, length, prompter, random.Random(seed))
    units = sizer.largest_fitting()
    inc = spec.increment(length)
    samples = []
    for index in range(num_samples):
        used = units
        while True:
            draft, prompt, tokens = sizer.try_units(used, index)
            if tokens <= sizer.budget:
                break
            if used - inc < 1:
                raise ValueError(f"{task} sample {index} does not fit {length} tokens")
            used -= inc
        samples.append({
            "index": index,
            "task": task,
            "length": length,
            "prompt": prompt,
            "references": list(draft.references),
            "max_new_tokens": spec.max_new_tokens,
            "answer_prefix": draft.answer_prefix,
            "prompt_tokens": tokens,
            "filler_units": used,
            "template": prompter.template,
            "generator": "ours",
            **draft.extra,
        })
    return samples


def generate_samples(tokenizer, lengths, tasks="all", num_samples: int = 10, template: str = "chat",
                     seed: int = DEFAULT_SEED) -> list[dict]:
    """Samples for every (task, length), tasks outer, lengths inner. See generate_task_samples."""
    data.ensure_ruler_data()
    prompter = Prompter(tokenizer, template)
    out: list[dict] = []
    for task in resolve_tasks(tasks):
        for length in lengths:
            out += generate_task_samples(task, int(length), num_samples, prompter, seed)
    return out
