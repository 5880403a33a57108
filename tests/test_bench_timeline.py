"""bench/timeline.py's step analysis on hand-made timelines (the GPU runs feed it torch.profiler events)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from timeline import Interval, describe, step_timeline  # noqa: E402


def test_wall_splits_into_busy_launch_latency_gaps_and_host_time():
    launches = [Interval("cudaGraphLaunch", 0, 30), Interval("cudaGraphLaunch", 100, 120),
                Interval("cudaGraphLaunch", 200, 210)]
    device = [Interval("a", 10, 40), Interval("b", 35, 50), Interval("c", 60, 90),  # step 1: overlap, gap 10
              Interval("a", 130, 150), Interval("c", 150, 170)]  # step 2: no gap
    t = step_timeline(device, launches)
    assert t["steps"] == 2
    assert t["wall_us"] == 100
    assert t["busy_us"] == (70 + 40) / 2
    assert t["before_first_us"] == (10 + 30) / 2
    assert t["between_us"] == 10 / 2
    assert t["after_last_us"] == (10 + 30) / 2
    assert t["launch_call_us"] == (30 + 20) / 2
    assert t["busy_us"] + t["before_first_us"] + t["between_us"] + t["after_last_us"] == t["wall_us"]
    assert t["worst_gaps"] == [{"before": "b", "after": "c", "per_step": 0.5, "us_per_step": 5.0}]
    assert "GPU busy 55" in describe(t)


def test_a_kernel_crossing_the_next_launch_is_clipped_to_each_step():
    launches = [Interval("cudaGraphLaunch", 0, 1), Interval("cudaGraphLaunch", 50, 51),
                Interval("cudaGraphLaunch", 80, 81)]
    t = step_timeline([Interval("long", 20, 70)], launches)
    assert t["busy_us"] == (30 + 20) / 2
    assert t["before_first_us"] == (20 + 0) / 2
    assert t["after_last_us"] == (0 + 10) / 2


def test_one_launch_is_not_a_step():
    with pytest.raises(ValueError, match="at least 2 graph launches"):
        step_timeline([], [Interval("cudaGraphLaunch", 0, 1)])
