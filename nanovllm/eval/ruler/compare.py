"""Side by side: two RULER runs (ruler.json from `nanovllm ruler`), per task and length, scores and prompt lengths.

    python -m nanovllm.eval.ruler.compare out_official/ruler.json out_ours/ruler.json --names official ours

Made for comparing the two sample generators (docs/RULER_PARITY.md); works for any two runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _cells(run: dict) -> dict[tuple[str, int], list[dict]]:
    cells: dict[tuple[str, int], list[dict]] = {}
    for s in run["samples"]:
        cells.setdefault((s["task"], int(s["length"])), []).append(s)
    return cells


def _score(rows: list[dict]) -> str:
    return f"{statistics.mean(r['score'] for r in rows):.1f} ({sum(r['passed'] for r in rows)}/{len(rows)})"


def _tokens(rows: list[dict]) -> str:
    n = [r["prompt_tokens"] for r in rows]
    return f"{statistics.mean(n):,.0f} [{min(n):,}-{max(n):,}]"


def comparison_table(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Markdown: task, length, both scores (mean, passed/samples), both prompt lengths (mean [min-max]), and the
    difference of the mean prompt lengths; then per length the averages of the task scores with their standard
    errors and the difference of the averages."""
    ca, cb = _cells(a), _cells(b)
    x, y = names
    lines = [f"| task | length | {x} score | {y} score | {x} prompt tokens | {y} prompt tokens | {y} vs {x} length |",
             "|---|---|---|---|---|---|---|"]
    by_length: dict[int, tuple[list[list[dict]], list[list[dict]]]] = {}
    for cell in (c for c in ca if c in cb):
        ra, rb = ca[cell], cb[cell]
        ma = statistics.mean(r["prompt_tokens"] for r in ra)
        mb = statistics.mean(r["prompt_tokens"] for r in rb)
        lines.append(f"| {cell[0]} | {cell[1]} | {_score(ra)} | {_score(rb)} | {_tokens(ra)} | {_tokens(rb)} | "
                     f"{100 * (mb / ma - 1):+.1f}% |")
        by_length.setdefault(cell[1], ([], []))[0].append(ra)
        by_length[cell[1]][1].append(rb)
    for length, (ta, tb) in by_length.items():
        (mean_a, se_a), (mean_b, se_b) = _average(ta), _average(tb)
        lines.append(f"| **average ± standard error** | {length} | **{mean_a:.2f} ± {se_a:.2f}** | "
                     f"**{mean_b:.2f} ± {se_b:.2f}** | | | {y} - {x}: {mean_b - mean_a:+.2f} ± "
                     f"{(se_a ** 2 + se_b ** 2) ** 0.5:.2f} |")
    return "\n".join(lines)


def _average(tasks: list[list[dict]]) -> tuple[float, float]:
    """Unweighted mean of the task scores and its standard error (sample variance within each task)."""
    means = [statistics.mean(r["score"] for r in rows) for rows in tasks]
    variance = sum(statistics.variance([r["score"] for r in rows]) / len(rows) for rows in tasks if len(rows) > 1)
    return statistics.mean(means), variance ** 0.5 / len(tasks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs=2, type=Path, metavar="RULER_JSON")
    parser.add_argument("--names", nargs=2, default=("A", "B"))
    args = parser.parse_args(argv)
    a, b = (json.loads(p.read_text()) for p in args.runs)
    print(comparison_table(a, b, tuple(args.names)))


if __name__ == "__main__":
    main()
