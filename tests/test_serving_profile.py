"""The serving benchmark's server profile: py-spy's raw stacks summarised, and the option's limits."""
from __future__ import annotations

import argparse
import os

import pytest

from nanovllm import serving_profile
from nanovllm.serving_bench import add_bench_arguments, run
from nanovllm.serving_profile import server_processes, top_self_functions

RAW = """\
process 7:"python";thread (0x1);loop (a.py:3);step (b.py:10);forward (c.py:20) 6
process 7:"python";thread (0x1);loop (a.py:3);step (b.py:11);forward (c.py:22) 2
process 7:"python";thread (0x1);loop (a.py:3);send (d.py:5) 2
not a stack line
"""


def test_top_self_functions_counts_innermost_frames_without_line_numbers():
    samples, top = top_self_functions(RAW, limit=5)
    assert samples == 10
    assert top == [("forward (c.py)", 0.8), ("send (d.py)", 0.2)]
    assert top_self_functions("", 5) == (0, [])


def bench_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(extra))


def test_profile_server_needs_py_spy_and_a_server_of_its_own(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="not one at --url"):
        run(bench_args("--profile-server", "--url", "http://127.0.0.1:9", "--output-dir", str(tmp_path)), {}, [])
    monkeypatch.setattr(serving_profile.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="needs py-spy on PATH"):
        run(bench_args("--profile-server", "--output-dir", str(tmp_path)), {}, [])


def test_server_processes_of_a_process_without_named_children():
    assert server_processes(os.getpid()) == {"front end 0": os.getpid()}


def test_busy_cores_keeps_that_many_processes_spinning_while_the_block_runs():
    """--peer-cpu-load's load: inside the block `count` child processes each burn CPU; afterwards they are gone."""
    import multiprocessing
    import time

    from nanovllm.serving_bench import busy_cores, process_cpu_seconds

    with busy_cores(2):
        spinners = multiprocessing.active_children()
        assert len(spinners) == 2
        before = [process_cpu_seconds(p.pid) for p in spinners]
        time.sleep(0.5)
        burnt = [process_cpu_seconds(p.pid) - b for p, b in zip(spinners, before)]
    assert all(cpu > 0.1 for cpu in burnt), burnt
    assert not any(p.is_alive() for p in spinners)
    with busy_cores(0):
        assert not multiprocessing.active_children()


def _after_start_up(start_up: float, ready) -> float:
    import time

    time.sleep(start_up)  # a child slow to import
    ready.wait()
    return time.time()


def test_client_processes_start_together_however_long_each_takes_to_start_up():
    """bench serving's client processes send their first requests together: one 1.5 s later to start up than the
    other still goes past the barrier with it (a fixed start time, as before, let the early one run alone)."""
    from nanovllm.serving_bench import start_together

    went = start_together(_after_start_up, [(0.0,), (1.5,)])
    assert max(went) - min(went) < 0.2, went
