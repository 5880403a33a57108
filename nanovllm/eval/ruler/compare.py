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
    difference of the mean prompt lengths; then the per-length averages of the task scores."""
    ca, cb = _cells(a), _cells(b)
    x, y = names
    lines = [f"| task | length | {x} score | {y} score | {x} prompt tokens | {y} prompt tokens | {y} vs {x} length |",
             "|---|---|---|---|---|---|---|"]
    averages: dict[int, tuple[list[float], list[float]]] = {}
    for cell in (c for c in ca if c in cb):
        ra, rb = ca[cell], cb[cell]
        ma = statistics.mean(r["prompt_tokens"] for r in ra)
        mb = statistics.mean(r["prompt_tokens"] for r in rb)
        lines.append(f"| {cell[0]} | {cell[1]} | {_score(ra)} | {_score(rb)} | {_tokens(ra)} | {_tokens(rb)} | "
                     f"{100 * (mb / ma - 1):+.1f}% |")
        sa, sb = averages.setdefault(cell[1], ([], []))
        sa.append(statistics.mean(r["score"] for r in ra))
        sb.append(statistics.mean(r["score"] for r in rb))
    for length, (sa, sb) in averages.items():
        lines.append(f"| **average** | {length} | **{statistics.mean(sa):.2f}** | **{statistics.mean(sb):.2f}** | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs=2, type=Path, metavar="RULER_JSON")
    parser.add_argument("--names", nargs=2, default=("A", "B"))
    args = parser.parse_args(argv)
    a, b = (json.loads(p.read_text()) for p in args.runs)
    print(comparison_table(a, b, tuple(args.names)))


if __name__ == "__main__":
    main()
