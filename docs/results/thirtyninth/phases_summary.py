"""Per process (phases_<pid>.txt of phases/sitecustomize.py) and step kind: steps, and the mean and median host
microseconds of each phase. Usage: python phases_summary.py DIR"""
import glob
import statistics
import sys

PHASES = ("schedule", "plan", "launch", "resolve", "total")
for path in sorted(glob.glob(sys.argv[1] + "/phases_*.txt")):
    by_kind: dict[str, list[list[int]]] = {}
    for line in open(path):
        kind, *values = line.split()
        by_kind.setdefault(kind, []).append([int(v) for v in values])
    print(path)
    for kind, rows in sorted(by_kind.items()):
        columns = list(zip(*rows))
        cells = ", ".join(f"{p} {statistics.mean(c) / 1e3:.2f}/{statistics.median(c) / 1e3:.2f}"
                          for p, c in zip(PHASES, columns))
        print(f"  {kind:8s} {len(rows):4d} steps, ms mean/median: {cells}; total {sum(columns[-1]) / 1e6:.3f} s")
