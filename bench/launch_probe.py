"""CUDA-graph launches without a profiler: wraps CUDAGraph.replay to time each call on the CPU and, on the GPU,
from an event queued before the launch to one after the graph; runs a bench script and prints the medians
per graph at exit (torch.profiler's CUPTI makes a launch of a few hundred kernels look ~1 ms long).

    PYTHONPATH=. python3 bench/launch_probe.py bench/sparse.py --skip-prefill --skip-gpu-only --decode-cases 1x131072
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import time
from collections import defaultdict

import torch

KEPT = 1000  # replays kept per graph
calls: dict[int, list] = defaultdict(list)
_replay = torch.cuda.CUDAGraph.replay


def timed_replay(self) -> None:
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    start = time.perf_counter()
    _replay(self)
    cpu = time.perf_counter() - start
    after.record()
    if len(calls[id(self)]) < KEPT:
        calls[id(self)].append((cpu, before, after))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@atexit.register
def report() -> None:
    if not calls:
        return
    torch.cuda.synchronize()
    for key, kept in calls.items():
        if len(kept) >= 4:
            cpu = median([c for c, _, _ in kept]) * 1e6
            gpu = median([a.elapsed_time(b) for _, a, b in kept]) * 1e3
            print(f"graph {key:x}: {len(kept)} replays, median replay() call {cpu:.0f} us on the CPU, "
                  f"{gpu:.0f} us on the GPU from before the launch to after the graph", flush=True)


if __name__ == "__main__":
    torch.cuda.CUDAGraph.replay = timed_replay
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
