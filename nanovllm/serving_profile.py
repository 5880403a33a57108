"""Where a served run's CPU time goes: py-spy sampling profiles of the server's processes (the engine process
and each HTTP front end) over one benchmark run (`nanovllm bench serving --profile-server`).

py-spy (`pip install py-spy`; not a dependency) samples each process's Python stacks without stopping it
(`--nonblocking`); only threads doing work are sampled (idle ones are left out), so a function's share is
of the time the process was busy. Each process's raw stacks go to a file; the report keeps the functions
that were on top of the most samples (their own time, line numbers dropped).
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

ENGINE_PROCESS_NAME = "nanovllm-core"
FRONT_END_PROCESS_NAME = "nanovllm-api"


def find_py_spy() -> str:
    path = shutil.which("py-spy")
    if path is None:
        raise ValueError("--profile-server needs py-spy on PATH (pip install py-spy)")
    return path


def front_end_pids(server_pid: int | None) -> list[int]:
    """The server's HTTP front-end processes: its children named nanovllm-api (`serve --api-server-count N`,
    N > 1), else the server process itself."""
    if server_pid is None:
        return []
    named = [pid for pid in _children(server_pid) if _name(pid) == FRONT_END_PROCESS_NAME]
    return named or [server_pid]


def server_processes(server_pid: int) -> dict[str, int]:
    """{"engine": pid, "front end 0": pid, ...}: the server's engine process (its child named nanovllm-core,
    if any: `--engine-core thread` has none) and its HTTP front ends."""
    engine = [pid for pid in _children(server_pid) if _name(pid) == ENGINE_PROCESS_NAME]
    front_ends = {f"front end {k}": pid for k, pid in enumerate(front_end_pids(server_pid))}
    return {**({"engine": engine[0]} if engine else {}), **front_ends}


class ServerProfile:
    """py-spy recording each process until stop(); raw stacks in out_dir/<stem>_<role>.txt."""

    def __init__(self, processes: dict[str, int], out_dir: Path, stem: str, rate_hz: int = 200):
        py_spy = find_py_spy()
        self.files = {role: out_dir / f"{stem}_{role.replace(' ', '_')}.txt" for role in processes}
        self.logs = {role: path.with_suffix(".log") for role, path in self.files.items()}  # py-spy's own messages
        self.recorders = {}
        for role, pid in processes.items():
            with self.logs[role].open("w") as log:
                self.recorders[role] = subprocess.Popen(
                    [py_spy, "record", "--pid", str(pid), "--rate", str(rate_hz), "--format", "raw", "--nonblocking",
                     "--output", str(self.files[role])], stdout=subprocess.DEVNULL, stderr=log)

    def stop(self, limit: int = 12) -> dict[str, dict]:
        """End the recordings (py-spy writes its file on SIGINT); per process its samples and top functions
        [(function, share of its samples)], or the error py-spy gave."""
        for recorder in self.recorders.values():
            recorder.send_signal(signal.SIGINT)
        report = {}
        for role, recorder in self.recorders.items():
            try:
                recorder.wait(timeout=60)
            except subprocess.TimeoutExpired:
                recorder.kill()
                recorder.wait()
            path = self.files[role]
            if not path.exists():
                report[role] = {"error": self.logs[role].read_text(errors="replace").strip()[-500:] or "no output"}
                continue
            samples, top = top_self_functions(path.read_text(), limit)
            report[role] = {"samples": samples, "top": top, "file": path.name}
        return report


_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_LINE_NUMBER = re.compile(r":\d+\)$")


def top_self_functions(raw: str, limit: int = 12) -> tuple[int, list[tuple[str, float]]]:
    """(samples, [(function, share)]) from py-spy's raw format (one "frame;frame;...;frame count" per line,
    outermost first, a frame "function (file:line)"): the innermost frames, their line numbers dropped."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        match = _LINE.match(line.strip())
        if match is None:
            continue
        innermost = match["stack"].rsplit(";", 1)[-1]
        counts[_LINE_NUMBER.sub(")", innermost)] += int(match["count"])
    total = sum(counts.values())
    return total, [(name, n / total) for name, n in counts.most_common(limit)] if total else []


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
