"""The server's engine loop: the one owner of the LLMEngine while a server runs.

`EngineLoop` alone calls add_request, abort_request and step(). It takes commands ("add", id, token_ids, params),
("abort", id), ("finish", id) (a stop string ended the request: free it, count no abort) and reports what happened
to a `CoreEvents` (the front end, server/async_engine.py). `ThreadCore` runs it in a thread of the server process,
over an LLM the caller built (`--engine-core thread`; tests inject faults so); server/engine_core.py runs it in a
process of its own.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Protocol

from nanovllm.engine.llm_engine import EngineStats, LLMEngine, StepFailed
from nanovllm.engine.request_state import RequestState
from nanovllm.outputs import RequestOutput

log = logging.getLogger("nanovllm.server")

MAX_CONSECUTIVE_STEP_FAILURES = 3  # more failed steps in a row than this: the engine is broken


class RequestFailed(Exception):
    """The request was accepted but could not be completed (its step failed); the engine goes on."""


class CoreEvents(Protocol):
    """What the engine loop reports, in order, from the thread that runs it."""

    def accepted(self, request_id: str) -> None: ...

    def refused(self, request_id: str, error: Exception) -> None: ...

    def stepped(self, outputs: list[RequestOutput] | list[RequestState], first_scheduled: list[str],
                step_started: float, stats: EngineStats) -> None: ...  # states when the loop builds no outputs

    def failed(self, request_id: str, error: Exception) -> None: ...

    def released(self, request_id: str, kind: str) -> None: ...  # after an "abort" or "finish" command

    def fatal(self, error: BaseException) -> None: ...


class EngineLoop:
    """Applies commands and runs steps until stopped and idle. `step_started` times are time.monotonic().
    With `build_outputs` False the events get each step's `RequestState`s rather than `RequestOutput`s
    (the engine process reads token deltas straight from their sequences)."""

    def __init__(self, engine: LLMEngine, events: CoreEvents, build_outputs: bool = True):
        self.engine = engine
        self.events = events
        self._engine_step = engine.step if build_outputs else engine.step_states
        self._commands: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._live: set[str] = set()  # admitted and not yet ended
        # admitted, first step not yet run (for the queue-time metric): by sequence id, and back
        self._unscheduled: dict[int, str] = {}
        self._unscheduled_seq: dict[str, int] = {}
        self._failed_steps_in_a_row = 0
        self.failed = False  # run() ended because the engine broke

    def post(self, command: tuple) -> None:
        self.post_many([command])

    def post_many(self, commands: list[tuple]) -> None:
        if not commands:
            return
        with self._cond:
            self._commands.extend(commands)
            self._cond.notify()

    def stop(self) -> None:
        """Finish what is held, then return from run()."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def run(self) -> None:
        try:
            while self._next_commands() is not None or self.engine.has_unfinished_requests():
                started = time.monotonic()
                outputs = self._step() if self.engine.has_unfinished_requests() else []
                self.events.stepped(outputs, self._first_scheduled(), started, self.engine.stats())
        except BaseException as e:  # noqa: BLE001 - the engine itself is broken: report it and stop
            log.critical("the engine failed and stops; the server will exit: %r", e, exc_info=e)
            self.failed = True
            self.events.fatal(e)

    def _next_commands(self) -> list[tuple] | None:
        """Apply queued commands, waiting for some while idle; None once stopping and idle."""
        with self._cond:
            while not self._commands and not self.engine.has_unfinished_requests():
                if self._stopping:
                    return None
                self._cond.wait()
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            self._apply(command)
        return commands

    def _apply(self, command: tuple) -> None:
        kind, request_id = command[0], command[1]
        if kind == "add":
            self._add(request_id, *command[2:])
        elif request_id in self._live:  # still in the engine: free its blocks
            self._forget(request_id)
            self.engine.abort_request(request_id)
            self.events.released(request_id, kind)

    def _add(self, request_id: str, token_ids: list[int], params) -> None:
        try:
            self.engine.add_request(token_ids, params, request_id, detokenize=False)
        except (ValueError, TypeError) as e:
            self.events.refused(request_id, e)
            return
        except Exception as e:  # noqa: BLE001 - a bug of admission must not end the engine loop
            log.exception("add_request failed")
            self.engine.abort_request(request_id)
            self.events.refused(request_id, RequestFailed(f"the engine could not admit the request: {e!r}"))
            return
        self._live.add(request_id)
        seq_id = self.engine.requests[request_id].seq.seq_id
        self._unscheduled[seq_id], self._unscheduled_seq[request_id] = request_id, seq_id
        self.events.accepted(request_id)

    def _step(self) -> list[RequestOutput] | list[RequestState]:
        try:
            outputs = self._engine_step()
        except StepFailed as e:
            self._failed_steps_in_a_row += 1
            log.error("%s", e, exc_info=e.__cause__)
            lost = [rid for rid in self._live if rid not in self.engine.requests]  # finished in that step
            error = RequestFailed(f"the request failed in the engine: {e.__cause__!r}")
            for request_id in dict.fromkeys([*e.request_ids, *lost]):
                if request_id in self._live:
                    self._forget(request_id)
                    self.events.failed(request_id, error)
            if self._failed_steps_in_a_row > MAX_CONSECUTIVE_STEP_FAILURES:
                raise RuntimeError(f"{self._failed_steps_in_a_row} steps in a row failed; last: {e}") from e
            return []
        self._failed_steps_in_a_row = 0
        outputs = [out for out in outputs if out.request_id in self._live]
        for out in outputs:
            if out.finished:  # still unscheduled if this was its first step: _first_scheduled reports it
                self._live.discard(out.request_id)
        return outputs

    def _first_scheduled(self) -> list[str]:
        """Requests whose first step was the one just run: those the step took from the waiting queue for the
        first time (a scan of every unscheduled request cost 3 ms per step with 2,000 queued, CPU)."""
        if not self._unscheduled:
            return []
        admitted = self.engine.admitted_seq_ids()
        done = [self._unscheduled.pop(seq_id) for seq_id in admitted if seq_id in self._unscheduled]
        for request_id in done:
            del self._unscheduled_seq[request_id]
        return done

    def _forget(self, request_id: str) -> None:
        self._live.discard(request_id)
        seq_id = self._unscheduled_seq.pop(request_id, None)
        if seq_id is not None:
            del self._unscheduled[seq_id]


class ThreadCore:
    """The engine loop in a thread of this process, over an LLM built by the caller."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._loop: EngineLoop | None = None
        self._thread: threading.Thread | None = None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def start(self, events: CoreEvents) -> None:
        self._loop = EngineLoop(self.engine, events)
        self._thread = threading.Thread(target=self._loop.run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    def post(self, command: tuple) -> None:
        self._loop.post(command)

    def stop(self, timeout: float | None = None) -> None:
        self._loop.stop()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the loop to end (stopped, or broken)."""
        self._thread.join(timeout)

    def kill(self) -> None:
        """Nothing to do: the loop's thread is a daemon and ends with the process."""
