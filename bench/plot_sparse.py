"""Chart of bench/sparse.py results: block-sparse speed-up over the dense peer of the same run, against
context length (prefill attention, with the density selected) and per decode case and token budget.

    python3 bench/plot_sparse.py OUT.png RESULT.json [RESULT.json ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def points(results: list[dict]) -> tuple[list[tuple], list[tuple]]:
    """(context, stride, density, speed-up vs fastest dense) per prefill row; (label, speed-up) per decode row."""
    prefill, decode = [], []
    for r in results:
        for row in r.get("prefill_attention", []):
            prefill.append((row["context"], row["stride"], row["density"], row["speedup_vs_fastest_dense"]))
        for mode in ("offload_decode", "gpu_only_decode"):
            for case in r.get(mode, []):
                for name, peer in case.items():
                    if isinstance(peer, dict) and "speedup_vs_dense" in peer:
                        where = "offload" if mode == "offload_decode" else "GPU"
                        label = f"{where}\n{case['batch']}x{round(case['context'] / 1024)}K\nbudget {name.split('_')[-1]}"
                        decode.append((label, peer["speedup_vs_dense"]))
    return prefill, decode


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, files = sys.argv[1], sys.argv[2:]
    prefill, decode = points([json.loads(Path(f).read_text()) for f in files])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 2]})
    for stride in sorted({p[1] for p in prefill}):
        rows = sorted(p for p in prefill if p[1] == stride)
        left.plot([p[0] // 1024 for p in rows], [p[3] for p in rows], marker="o", label=f"stride {stride}")
        for context, _, density, speedup in rows:
            left.annotate(f"density {density:.2f}", (context // 1024, speedup), textcoords="offset points", xytext=(4, 6),
                          fontsize=8)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xlabel="context (K tokens)", ylabel="speed-up vs fastest causal dense",
             title="XAttention prefill attention, one layer")
    left.legend()
    right.bar(range(len(decode)), [d[1] for d in decode], color="tab:orange")
    right.set_xticks(range(len(decode)), [d[0] for d in decode], fontsize=7)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(ylabel="speed-up vs dense decode, same sequences", title="Quest decode at 128K (host-side selection)")
    fig.suptitle("Block-sparse attention on one H200, Llama-3.1-8B shape (bench/sparse.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"chart written to {out}")


if __name__ == "__main__":
    main()
