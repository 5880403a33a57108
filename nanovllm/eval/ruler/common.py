"""Pieces shared by the task generators."""
from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass
class Draft:
    """One generated instance before wrapping: task text (the user turn), answer prefix, references."""

    task_text: str
    answer_prefix: str
    references: list[str]
    extra: dict = field(default_factory=dict)  # written into the sample (e.g. needle depth)


def random_name(rng: random.Random, length: int = 5) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=length))


def unique_names(rng: random.Random, count: int, length: int = 5) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = random_name(rng, length)
        if name not in names:
            names.append(name)
    return names


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def insert_lines(rng: random.Random, filler: list[str], items: list[str]) -> tuple[list[str], list[int]]:
    """Insert ``items`` (in their order) before distinct random filler lines.

    Returns the lines and the final index of each item.
    """
    if len(items) > len(filler):
        raise ValueError(f"cannot place {len(items)} items among {len(filler)} filler lines")
    slots = sorted(rng.sample(range(len(filler)), len(items)))
    lines: list[str] = []
    where: list[int] = []
    pending = iter(zip(slots, items))
    nxt = next(pending, None)
    for i, line in enumerate(filler):
        while nxt is not None and nxt[0] == i:
            where.append(len(lines))
            lines.append(nxt[1])
            nxt = next(pending, None)
        lines.append(line)
    return lines, where
