"""The tensor-parallel worker processes: ranks 1..N-1, started by the engine, one step plan per step.

The driver (the engine's process) is rank 0: it schedules, plans, and executes each plan on its own
`Worker` after sending it to the other ranks through shared memory (`PlanChannel`: the pickled plan and
an event per worker; measured faster than `broadcast_object_list`, see bench/plan_broadcast.py). Every
rank runs the same forward pass on its own heads; only rank 0 samples.

Failure and shut-down: a worker that raises reports the error through its pipe and exits, which breaks
the driver's pending collective (gloo: connection closed; NCCL: a monitor thread aborts the group), and
the driver raises `TensorParallelError` naming the rank and the worker's exception, then stops the others.
`shutdown()` (also at interpreter exit and when the group is garbage-collected) stops, joins and if need
be kills the workers; a worker whose driver dies exits by itself.

Test-only: with NANOVLLM_TEST_TP_FAIL="<rank>:<step>" in the environment, worker <rank> raises at its
<step>-th plan (0-based), so tests can check the error and that no process is left behind.
"""
from __future__ import annotations

import os
import pickle
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing import connection, shared_memory
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import EngineConfig
from nanovllm.distributed.parallel_state import TensorParallel, destroy_group, init_group
from nanovllm.engine.memory import resolve_device

CHANNEL_BYTES = 1 << 26  # largest pickled plan: 64 MiB of address space, touched only as far as used
POLL_S = 0.5  # how often an idle worker checks that its driver is alive
STARTUP_TIMEOUT_S = 300.0  # spawn + import, before the process group exists
FAILURE_WAIT_S = 5.0  # after a failed step, how long the driver waits for a worker's report
STOP_TIMEOUT_S = 10.0
TEST_FAIL_ENV = "NANOVLLM_TEST_TP_FAIL"


class TensorParallelError(RuntimeError):
    """A rank failed or the group was stopped; the engine cannot run further steps."""


class PlanChannel:
    """Driver -> workers: one pickled message at a time in shared memory, an event per worker to wake it.
    A worker copies the message out before its first collective of the step, so the driver can never
    overwrite a message that is still being read."""

    def __init__(self, events: list, size: int = CHANNEL_BYTES):
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.events = events

    @property
    def name(self) -> str:
        return self.shm.name

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + 8 > self.shm.size:
            raise ValueError(f"a step plan of {len(data)} bytes exceeds the {self.shm.size}-byte plan channel")
        self.shm.buf[:8] = len(data).to_bytes(8, "little")
        self.shm.buf[8 : 8 + len(data)] = data
        for event in self.events:
            event.set()

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


class PlanReceiver:
    """A worker's end of the channel."""

    def __init__(self, name: str, event):
        self.shm = shared_memory.SharedMemory(name=name)
        self.event = event

    def receive(self, driver_alive: Callable[[], bool]) -> Any:
        while not self.event.wait(POLL_S):
            if not driver_alive():
                raise SystemExit("the tensor-parallel driver exited")
        self.event.clear()
        n = int.from_bytes(self.shm.buf[:8], "little")
        return pickle.loads(self.shm.buf[8 : 8 + n])

    def close(self) -> None:
        self.shm.close()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_devices(config: EngineConfig) -> torch.device:
    """The device kind every rank uses; ValueError, before anything starts, when there are too few GPUs."""
    device = resolve_device(config.device)
    n = config.tensor_parallel_size
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={n} exceeds the {torch.cuda.device_count()} visible GPU(s)")
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(device: torch.device, size: int) -> None:
    """On a CPU device the ranks share the cores (this also sets the driver process's torch threads)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


class TensorParallelGroup:
    """Ranks 1..N-1 in their own processes; the caller's process joins as rank 0 (`tp`)."""

    def __init__(self, config: EngineConfig, model_dir: Path | None):
        device = check_devices(config)
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process: one "
                               "tensor-parallel engine per process at a time (shut the other one down)")
        size, backend = config.tensor_parallel_size, backend_for(device)
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (inherited by the workers)
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.tp = TensorParallel(0, size)
        self.channel = PlanChannel([ctx.Event() for _ in range(size - 1)])
        self.procs, self.pipes = [], []
        for rank in range(1, size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                               args=(TensorParallel(rank, size), config, model_dir, backend, init_method,
                                     self.channel.name, self.channel.events[rank - 1], writer))
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.pipes.append(reader)
        self.failure: str | None = None
        self._stopped = False
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.channel, True)
        self._await_started(STARTUP_TIMEOUT_S)
        _threads_per_rank(device, size)
        with self.guard():
            init_group(self.tp, backend, init_method)
        if backend == "nccl":
            threading.Thread(target=self._monitor, daemon=True, name="nanovllm-tp-monitor").start()

    # ---- steps -----------------------------------------------------------------------------
    def run(self, worker, method: str, plan) -> Any:
        """Send the plan to ranks 1..N-1 and execute it on rank 0's worker."""
        with self.guard():
            self.channel.send((method, plan))
            return getattr(worker, method)(plan)

    @contextmanager
    def guard(self):
        """Any error inside becomes a TensorParallelError naming the failed rank; the group is then stopped."""
        self._check_alive()
        try:
            yield
        except Exception as e:
            raise TensorParallelError(self._fail(e)) from e
        except BaseException:
            self._fail(None)
            raise

    # ---- failures --------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group is stopped: {self.failure}")
        for proc, pipe in zip(self.procs, self.pipes):
            if pipe.poll() or not proc.is_alive():
                raise TensorParallelError(self._fail(None))

    def _fail(self, error: BaseException | None) -> str:
        """Collect the workers' reports (waiting briefly for them), stop the group and say what failed."""
        reports = self._reports(FAILURE_WAIT_S)
        if reports:
            self.failure = "; ".join(f"tensor-parallel worker rank {r} failed: {msg}" for r, msg in reports)
        else:
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
            if dead:
                self.failure = "; ".join(f"tensor-parallel worker rank {r} exited with code {c}" for r, c in dead)
            else:
                self.failure = f"tensor-parallel rank 0 (the driver) failed: {error!r}"
        self.shutdown()
        return self.failure

    def _reports(self, timeout: float) -> list[tuple[int, str]]:
        """(rank, error) from every worker that reported, waiting up to timeout for a report or an exit."""
        waiting = {pipe: rank for rank, pipe in enumerate(self.pipes, start=1)}
        sentinels = [p.sentinel for p in self.procs]
        connection.wait(list(waiting) + sentinels, timeout)
        reports = []
        for pipe, rank in waiting.items():
            if pipe.poll():
                kind, message = _receive(pipe)
                if kind == "error":
                    reports.append((rank, message))
        return reports

    def _monitor(self) -> None:
        """NCCL: a dead worker would leave the driver's collectives waiting; abort them instead."""
        connection.wait([p.sentinel for p in self.procs])
        if not self._stopped and dist.is_initialized():
            dist.distributed_c10d._abort_process_group()

    # ---- start and stop --------------------------------------------------------------------
    def _await_started(self, timeout: float) -> None:
        """Wait until every worker has started; one that reports an error, dies or is late stops the group."""
        pending = dict(enumerate(self.pipes, start=1))
        deadline = time.monotonic() + timeout
        while pending and self.failure is None:
            waitables = list(pending.values()) + [self.procs[r - 1].sentinel for r in pending]
            if not connection.wait(waitables, max(0.0, deadline - time.monotonic())):
                self.failure = f"tensor-parallel workers {sorted(pending)} did not start within {timeout:.0f} s"
            for rank, pipe in list(pending.items()):
                if pipe.poll():
                    kind, message = _receive(pipe)
                    if kind == "started":
                        del pending[rank]
                    else:
                        self.failure = f"tensor-parallel worker rank {rank} failed: {message or 'exited during start-up'}"
                elif not self.procs[rank - 1].is_alive():
                    self.failure = f"tensor-parallel worker rank {rank} exited with code " \
                                   f"{self.procs[rank - 1].exitcode} during start-up"
        if self.failure is not None:
            failure = self.failure
            self.shutdown()
            raise TensorParallelError(failure)

    def shutdown(self) -> None:
        """Stop the workers (asking first when the group is healthy), then leave the process group."""
        if self._stopped:
            return
        self._stopped = True
        self._finalizer.detach()
        _stop_workers(self.procs, self.channel, self.failure is None)
        destroy_group()


def _stop_workers(procs: list, channel: PlanChannel, ask: bool) -> None:
    if ask and any(p.is_alive() for p in procs):
        channel.send(None)
    for proc in procs:
        proc.join(STOP_TIMEOUT_S if ask else 0.1)
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    channel.close()


def _worker_main(tp: TensorParallel, config: EngineConfig, model_dir: Path | None, backend: str, init_method: str,
                 channel_name: str, event, pipe) -> None:
    """Rank tp.rank: join the group, build the worker, then execute plans until told to stop."""
    from nanovllm.engine.worker import Worker

    receiver = None
    try:
        pipe.send(("started", None))
        _threads_per_rank(resolve_device(config.device), tp.size)
        init_group(tp, backend, init_method)
        worker = Worker(config, model_dir, tp)
        receiver = PlanReceiver(channel_name, event)
        fail_at = _test_failure_step(tp.rank)
        driver_alive = mp.parent_process().is_alive
        step = 0
        while (message := receiver.receive(driver_alive)) is not None:
            if step == fail_at:
                raise RuntimeError(f"injected test failure at step {step} ({TEST_FAIL_ENV})")
            method, plan = message
            getattr(worker, method)(plan)
            step += 1
    except SystemExit:
        pass
    except BaseException as e:
        traceback.print_exc()
        _report(pipe, _one_line(e))
        raise SystemExit(1)
    finally:
        if receiver is not None:
            receiver.close()
        destroy_group()


def _one_line(error: BaseException) -> str:
    """The exception and where it was raised (the full traceback goes to the worker's stderr)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{error!r}{where}"


def _receive(pipe) -> tuple[str, str | None]:
    try:
        return pipe.recv()
    except (EOFError, OSError):
        return "exited", None


def _report(pipe, message: str) -> None:
    try:
        pipe.send(("error", message))
    except (BrokenPipeError, OSError):
        pass


def _test_failure_step(rank: int) -> int | None:
    value = os.environ.get(TEST_FAIL_ENV)
    if not value:
        return None
    fail_rank, step = (int(x) for x in value.split(":"))
    return step if fail_rank == rank else None
