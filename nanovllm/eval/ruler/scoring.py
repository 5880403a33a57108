"""RULER's scoring: prediction cleaning, string_match_all / string_match_part, aggregates.

Scores are on a 0-100 scale. A sample passes when its score is at least half the maximum (>= 50).
"""
from __future__ import annotations

import re
from collections import defaultdict

_CONTROL = re.compile(r"[\x00-\x1f]")
PASS_THRESHOLD = 50.0
METRICS = ("all", "part")


def clean_prediction(text: str) -> str:
    """Strip, turn control characters into newlines, strip again."""
    return _CONTROL.sub("\n", text.strip()).strip()


def _found(ref: str, pred: str) -> float:
    return 1.0 if ref.lower() in pred.lower() else 0.0


def match_all(pred: str, refs: list[str]) -> float:
    """Fraction of references found in the prediction (case-insensitive substring), x 100."""
    return sum(_found(r, pred) for r in refs) / len(refs) * 100


def match_part(pred: str, refs: list[str]) -> float:
    """100 if any reference is found in the prediction, else 0."""
    return max(_found(r, pred) for r in refs) * 100


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """Mean over samples of match_all; predictions are used as given (clean them first)."""
    return sum(match_all(p, r) for p, r in zip(preds, refs, strict=True)) / len(preds)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    return sum(match_part(p, r) for p, r in zip(preds, refs, strict=True)) / len(preds)


def sample_score(metric: str, prediction: str, references: list[str]) -> float:
    """Score of one raw prediction (cleaned here) with metric "all" or "part"."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    pred = clean_prediction(prediction)
    return match_all(pred, references) if metric == "all" else match_part(pred, references)


def passed(score: float) -> bool:
    return score >= PASS_THRESHOLD


def summarize(records: list[dict]) -> dict:
    """Aggregate records with "task", "length" and "score" (0-100).

    Returns {"tasks": {task: {length: cell}}, "lengths": {length: cell}, "overall": cell} where a
    task cell is {"score", "passed", "total"} (score = mean sample score, rounded to 2 decimals) and a
    length cell's "score" is the unweighted mean of its task scores, with pass counts summed.
    """
    groups: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        groups[r["task"]][int(r["length"])].append(float(r["score"]))
    tasks = {
        task: {length: _cell(scores) for length, scores in sorted(by_length.items())}
        for task, by_length in groups.items()
    }
    lengths: dict[int, dict] = {}
    for length in sorted({length for by_length in tasks.values() for length in by_length}):
        cells = [by_length[length] for by_length in tasks.values() if length in by_length]
        lengths[length] = _merge(cells)
    return {"tasks": tasks, "lengths": lengths, "overall": _merge(list(lengths.values()))}


def _cell(scores: list[float]) -> dict:
    return {"score": round(sum(scores) / len(scores), 2), "passed": sum(passed(s) for s in scores),
            "total": len(scores)}


def _merge(cells: list[dict]) -> dict:
    if not cells:
        return {"score": 0.0, "passed": 0, "total": 0}
    return {"score": round(sum(c["score"] for c in cells) / len(cells), 2),
            "passed": sum(c["passed"] for c in cells), "total": sum(c["total"] for c in cells)}
