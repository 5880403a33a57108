"""The engine's steps by kind (decode / mixed / prefill: estep0/1/2 marks of engine_steps.patch), in the server's
engine process and in the bench's offline peer: count, total and median milliseconds.
Usage: python steps_compare.py TIMELINE_DIR"""
import glob
import statistics
import sys

names = {"estep0": "decode", "estep1": "mixed", "estep2": "prefill"}
for path in sorted(glob.glob(sys.argv[1] + "/timeline_*.txt")):
    by_kind: dict[str, list[float]] = {}
    for line in open(path):
        kind, _, n = line.split()
        if kind.startswith("estep"):
            by_kind.setdefault(names.get(kind, kind), []).append(int(n) / 1e3)
    if not by_kind:
        continue
    print(path)
    for kind, ms in sorted(by_kind.items()):
        big = sorted(ms)
        print(f"  {kind:8s} {len(ms):4d} steps, {sum(ms) / 1e3:.3f} s, median {statistics.median(ms):.2f} ms, "
              f"p10 {big[len(big) // 10]:.2f}, p90 {big[9 * len(big) // 10]:.2f}")
