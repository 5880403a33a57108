"""Chart the benchmark JSON files as ratios to their floors: bench/throughput.py and bench/latency.py
against the HBM floor; with bench/offload.py results given, their decode steps against the PCIe floor.

    python3 bench/plot.py docs/results docs/results/speed.png [offload.json ...]
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


def offload_bars(files: list[Path]) -> list[tuple[str, float]]:
    """(label, PCIe floor / decode time) of every offload case with host-resident KV (the first file's
    result where several files have the case)."""
    out = {}
    for f in files:
        for c in json.loads(f.read_text())["cases"]:
            if c.get("decode_vs_floor"):
                path = "graphs" if c["graph_steps"] else "eager"
                out.setdefault(f"{c['batch']}x{round(c['context'] / 1024)}K\n{path}", 1 / c["decode_vs_floor"])
    return list(out.items())


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results_dir, png = Path(sys.argv[1]), Path(sys.argv[2])
    panels = [("HBM floor", "nanovllm on one H200: speed against the memory-bandwidth floor", bars(results_dir))]
    if sys.argv[3:]:
        panels.append(("PCIe floor", "KV offload decode, Llama-8B shape: against the PCIe floor",
                       offload_bars([Path(f) for f in sys.argv[3:]])))
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 3.2 * len(panels)), squeeze=False)
    for ax, (floor, title, data) in zip(axes[:, 0], panels):
        ax.bar([d[0] for d in data], [100 * d[1] for d in data], color="#1f77b4")
        ax.axhline(100, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel(f"% of the {floor}\n(higher is better)")
        ax.set_ylim(0, 112)
        for i, (_, v) in enumerate(data):
            ax.text(i, 100 * v + 2, f"{100 * v:.0f}%", ha="center")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(png)


if __name__ == "__main__":
    main()
