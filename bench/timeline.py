"""Where a decode step's wall time goes on the GPU's timeline: kernels, idle gaps inside a step, the wait
from a CUDA-graph launch to its first kernel, and the wait after its last kernel for the host's next step.
Works on the events of torch.profiler (`from_profiler`); the analysis itself is a pure function of
intervals (`step_timeline`), tested on the CPU."""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple


class Interval(NamedTuple):
    name: str
    start: float  # us
    end: float


def _busy_and_gaps(events: list[Interval], lo: float, hi: float) -> tuple[float, list[tuple[float, str, str]]]:
    """Union length of the events clipped to [lo, hi], and the idle gaps between them (length, before, after)."""
    busy, gaps, reach, last = 0.0, [], None, ""
    for e in events:
        start, end = max(e.start, lo), min(e.end, hi)
        if end <= start:
            continue
        if reach is not None and start > reach:
            gaps.append((start - reach, last, e.name))
        if reach is None or end > reach:
            busy += end - max(start, reach if reach is not None else start)
            reach, last = end, e.name
    return busy, gaps


def step_timeline(device: list[Interval], launches: list[Interval], top: int = 6) -> dict:
    """Per window between consecutive graph launches (one decode step each): mean wall, GPU busy, the idle
    time before the first kernel (launch latency), between kernels and after the last one (host-bound),
    and the kernel pairs with the most idle time between them."""
    device = sorted(device, key=lambda e: e.start)
    launches = sorted(launches, key=lambda e: e.start)
    if len(launches) < 2:
        raise ValueError(f"need at least 2 graph launches to delimit a step, got {len(launches)}")
    totals = defaultdict(float)
    by_pair: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for launch, following in zip(launches, launches[1:]):
        lo, hi = launch.start, following.start
        inside = [e for e in device if e.end > lo and e.start < hi]
        busy, gaps = _busy_and_gaps(inside, lo, hi)
        first = min((max(e.start, lo) for e in inside), default=hi)
        last = max((min(e.end, hi) for e in inside), default=hi)
        totals["wall"] += hi - lo
        totals["busy"] += busy
        totals["launch_call"] += launch.end - launch.start
        totals["before_first"] += first - lo
        totals["after_last"] += hi - last
        totals["between"] += sum(g for g, _, _ in gaps)
        for length, before, after in gaps:
            entry = by_pair[(before, after)]
            entry[0] += 1
            entry[1] += length
    steps = len(launches) - 1
    worst = sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": steps, **{f"{k}_us": v / steps for k, v in totals.items()},
            "worst_gaps": [{"before": b, "after": a, "per_step": n / steps, "us_per_step": t / steps}
                           for (b, a), (n, t) in worst]}


def describe(t: dict) -> str:
    lines = [f"step timeline over {t['steps']} steps: wall {t['wall_us']:.0f} us = GPU busy {t['busy_us']:.0f} "
             f"+ launch-to-first-kernel {t['before_first_us']:.0f} + between kernels {t['between_us']:.0f} "
             f"+ after the last kernel {t['after_last_us']:.0f} (cudaGraphLaunch call {t['launch_call_us']:.0f} us)"]
    lines += [f"    {g['us_per_step']:7.1f} us/step in {g['per_step']:.1f} gaps: {g['before'][:50]} -> {g['after'][:50]}"
              for g in t["worst_gaps"]]
    return "\n".join(lines)


def from_profiler(prof) -> tuple[list[Interval], list[Interval]]:
    """(device kernels and copies, cudaGraphLaunch calls) of a finished torch.profiler run."""
    device, launches = [], []
    for e in prof.events():
        span = Interval(e.name, e.time_range.start, e.time_range.end)
        if e.device_type.name == "CUDA":
            device.append(span)
        elif e.name == "cudaGraphLaunch":
            launches.append(span)
    return device, launches


def timeline_of(prof) -> str:
    """`describe` of a profile whose decode steps ran in CUDA graphs; a line saying why not otherwise."""
    device, launches = from_profiler(prof)
    if len(launches) < 2:
        return f"step timeline: {len(launches)} graph launches, no step to delimit"
    return describe(step_timeline(device, launches))
