"""Reporting: the Markdown table (tasks x lengths, average, pass counts) and the PNG chart."""
from __future__ import annotations

import warnings
from pathlib import Path


def _label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def _fmt(cell: dict | None) -> str:
    return "-" if cell is None else f"{cell['score']:.2f} ({cell['passed']}/{cell['total']})"


def markdown_table(summary: dict) -> str:
    """Rows: tasks, then the per-length average; cells: score (0-100) and passed/total samples."""
    lengths = list(summary["lengths"])
    lines = ["| task | " + " | ".join(_label(n) for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for task, cells in summary["tasks"].items():
        lines.append(f"| {task} | " + " | ".join(_fmt(cells.get(n)) for n in lengths) + " |")
    lines.append("| **average** | " + " | ".join(f"**{_fmt(summary['lengths'][n])}**" for n in lengths) + " |")
    overall = summary["overall"]
    lines.append("")
    lines.append(f"Overall: {overall['score']:.2f} average score, {overall['passed']}/{overall['total']} samples "
                 f"passed (score >= 50).")
    return "\n".join(lines)


def save_chart(summary: dict, path: str | Path, title: str = "RULER") -> Path | None:
    """Grouped bars: one group per task (and the average), one bar per length. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'nanovllm[ruler]'): skipping the RULER chart",
                      stacklevel=2)
        return None
    lengths = list(summary["lengths"])
    groups = list(summary["tasks"]) + ["average"]
    width = 0.8 / max(1, len(lengths))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(groups) + 2), 4.8))
    for j, length in enumerate(lengths):
        scores = [summary["tasks"][t].get(length, {}).get("score", 0.0) for t in groups[:-1]]
        scores.append(summary["lengths"][length]["score"])
        xs = [i + (j - (len(lengths) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, scores, width, label=_label(length))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=45, ha="right")
    ax.set_ylim(0, 105)
    ax.set_ylabel("score (0-100)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(title="length", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
