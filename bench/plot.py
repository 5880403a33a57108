"""Chart the benchmark JSON files (bench/throughput.py, bench/latency.py) as ratios to their floors.

    python3 bench/plot.py docs/results docs/results/speed.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def bars(results_dir: Path) -> list[tuple[str, float]]:
    """(label, achieved fraction of the HBM floor) for every measured case."""
    out = []
    throughput = results_dir / "throughput.json"
    if throughput.is_file():
        t = json.loads(throughput.read_text())
        out.append((f"throughput\n{t['num_seqs']} seqs, Qwen3-0.6B", t["fraction_of_floor"]))
    latency = results_dir / "latency.json"
    if latency.is_file():
        for row in json.loads(latency.read_text())["decode"]:
            out.append((f"decode b{row['batch']}\n{row['context'] // 1024}K, Llama-8B", 1 / row["ratio_to_floor"]))
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results_dir, png = Path(sys.argv[1]), Path(sys.argv[2])
    data = bars(results_dir)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar([d[0] for d in data], [100 * d[1] for d in data], color="#1f77b4")
    ax.axhline(100, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("% of the HBM floor (higher is better)")
    ax.set_ylim(0, 105)
    for i, (_, v) in enumerate(data):
        ax.text(i, 100 * v + 2, f"{100 * v:.0f}%", ha="center")
    ax.set_title("nanovllm on one H200: speed against the memory-bandwidth floor")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(png)


if __name__ == "__main__":
    main()
