"""Needle-in-a-haystack tasks (8 of RULER's 13): noise, essay and needle haystacks."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.common import NOISE, Draft, insert_lines, random_uuid
from nanovllm.eval.ruler.templates import niah_texts

NEEDLE = "One of the special magic {type} for {key} is: {value}."
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))  # percent


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # "noise", "essay" or "needle" (every filler line a distractor needle)
    key_type: str  # "words", "numbers" or "uuids"
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1

    @property
    def incremental(self) -> int:  # filler units per step: essay words, else lines
        return 500 if self.haystack == "essay" else 25

    def increment_for(self, length: int) -> int:
        return 5 if self.haystack != "essay" and length < 4096 else self.incremental

    def max_units(self) -> int | None:
        return len(data.essay_words()) if self.haystack == "essay" else None


def random_item(rng: random.Random, kind: str) -> str:
    if kind == "words":
        adjectives, nouns = data.key_parts()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "numbers":
        return str(rng.randint(1000000, 9999999))
    if kind == "uuids":
        return random_uuid(rng)
    raise ValueError(f"unknown needle type {kind!r}")


def make_niah(spec: NiahSpec, rng: random.Random, units: int) -> Draft:
    """One NIAH instance with ``units`` filler units (essay words or haystack lines)."""
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[tuple[str, str]] = []  # (needle sentence, key)
    for _ in range(spec.num_keys):
        key = random_item(rng, spec.key_type)
        while key in keys:
            key = random_item(rng, spec.key_type)
        keys.append(key)
        values.append([random_item(rng, spec.value_type) for _ in range(spec.num_values)])
        needles += [(NEEDLE.format(type=spec.value_type, key=key, value=v), key) for v in values[-1]]
    rng.shuffle(needles)

    if spec.haystack == "essay":
        context, depth_of = _essay_context(rng, units, [n for n, _ in needles])
    else:
        if spec.haystack == "noise":
            filler = [NOISE] * units
        elif spec.haystack == "needle":
            filler = [_distractor(spec, rng, keys) for _ in range(units)]
        else:
            raise ValueError(f"unknown haystack {spec.haystack!r}")
        lines, where = insert_lines(rng, filler, [n for n, _ in needles])
        context = "\n".join(lines)
        depth_of = {needles[i][0]: round(100 * w / len(lines), 1) for i, w in enumerate(where)}

    asked = rng.sample(range(spec.num_keys), spec.num_queries)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    task_text, prefix = niah_texts(spec.value_type, context, query, len(answers))
    depths = [depth_of[NEEDLE.format(type=spec.value_type, key=keys[i], value=v)] for i in asked for v in values[i]]
    return Draft(task_text, prefix, answers, {"depth": depths[0], "depths": depths})


def _distractor(spec: NiahSpec, rng: random.Random, keys: list[str]) -> str:
    key = random_item(rng, spec.key_type)
    while key in keys:  # a distractor never shares a real key
        key = random_item(rng, spec.key_type)
    return NEEDLE.format(type=spec.value_type, key=key, value=random_item(rng, spec.value_type))


def _essay_context(rng: random.Random, units: int, needles: list[str]) -> tuple[str, dict[str, int]]:
    """First ``units`` essay words split into sentences, needles placed at depths drawn from DEPTHS."""
    sentences = data.sent_tokenize(" ".join(data.essay_words()[:units]).strip())
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    pieces: list[str] = []
    start = 0
    for needle, depth in zip(needles, depths):
        cut = int(len(sentences) * depth / 100)
        if cut > start:
            pieces.append(" ".join(sentences[start:cut]))
        pieces.append(needle)
        start = max(start, cut)
    if start < len(sentences):
        pieces.append(" ".join(sentences[start:]))
    return " ".join(pieces), dict(zip(needles, depths))
