"""The server's engine loop, apart from its HTTP front end: in a thread, or in a process of its own.

`EngineLoop` owns the LLMEngine: it alone calls add_request, abort_request and step(). It takes commands
("add", id, token_ids, params), ("abort", id), ("finish", id) (a stop string ended the request: free it,
count no abort) and reports what happened to a `CoreEvents` (the front end, server/async_engine.py).

Two ways to run it:
- `ThreadCore`: in a thread of the server process, over an LLM the caller built (tests inject faults so).
- `EngineProcess`: in a child process, as vLLM's EngineCore; the default of `nanovllm serve`. The engine's
  Python then never waits for the GIL that the event loop and the detokenizer hold, each step's outputs
  cross a pipe as token deltas, and an engine process that dies is reported like a broken engine.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import EngineStats, LLMEngine, StepFailed
from nanovllm.engine.model_files import load_tokenizer
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

log = logging.getLogger("nanovllm.server")

MAX_CONSECUTIVE_STEP_FAILURES = 3  # more failed steps in a row than this: the engine is broken


class RequestFailed(Exception):
    """The request was accepted but could not be completed (its step failed); the engine goes on."""


class CoreEvents(Protocol):
    """What the engine loop reports, in order, from the thread that runs it."""

    def accepted(self, request_id: str) -> None: ...

    def refused(self, request_id: str, error: Exception) -> None: ...

    def stepped(self, outputs: list[RequestOutput], first_scheduled: list[str], step_started: float,
                stats: EngineStats) -> None: ...

    def failed(self, request_id: str, error: Exception) -> None: ...

    def released(self, request_id: str, kind: str) -> None: ...  # after an "abort" or "finish" command

    def fatal(self, error: BaseException) -> None: ...


class EngineLoop:
    """Applies commands and runs steps until stopped and idle. `step_started` times are time.monotonic()."""

    def __init__(self, engine: LLMEngine, events: CoreEvents):
        self.engine = engine
        self.events = events
        self._commands: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._live: set[str] = set()  # admitted and not yet ended
        self._unscheduled: set[str] = set()  # admitted, first step not yet run (for the queue-time metric)
        self._failed_steps_in_a_row = 0

    def post(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
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
        self._unscheduled.add(request_id)
        self.events.accepted(request_id)

    def _step(self) -> list[RequestOutput]:
        try:
            outputs = self.engine.step()
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
        """Requests whose first step was the one just run (or that are gone since)."""
        if not self._unscheduled:
            return []
        requests = self.engine.requests
        done = [rid for rid in self._unscheduled
                if rid not in requests or requests[rid].seq.num_computed_tokens > 0]
        self._unscheduled.difference_update(done)
        return done

    def _forget(self, request_id: str) -> None:
        self._live.discard(request_id)
        self._unscheduled.discard(request_id)


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


# ---- the engine in its own process -----------------------------------------------------------

@dataclass(frozen=True)
class PoolLimits:
    """What check_request reads of the block manager, sent over from the engine process."""

    num_blocks: int
    num_host_blocks: int
    block_size: int

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class EngineProcess:
    """An LLM built and run in a child process. This side has what the front end reads of an engine:
    config, tokenizer, tokenize(), check_request() (the same code as LLMEngine's, over the pool's sizes).
    Options are LLM(...)'s; bad ones raise here as they would there."""

    tokenize = LLMEngine.tokenize
    check_request = LLMEngine.check_request

    def __init__(self, model: str | None = None, log_requests: bool = False, **options: Any):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; the child imports afresh
        commands_out, self._commands_in = context.Pipe(duplex=False)
        self._events, events_in = context.Pipe(duplex=False)
        self._process = context.Process(target=_engine_process_main, name="nanovllm-engine-core", args=(
            model, options, log_requests, logging.getLogger("nanovllm").getEffectiveLevel(), commands_out, events_in))
        self._process.start()
        commands_out.close()
        events_in.close()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._prompts: dict[str, list[int]] = {}
        self._rebuilt: dict[str, _Rebuilt] = {}
        info = self._receive_start()
        self.config: EngineConfig = info["config"]
        self.block_manager = info["pool"]
        self._stats: EngineStats = info["stats"]
        self.tokenizer = load_tokenizer(Path(self.config.model_path))

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _receive_start(self) -> dict:
        try:
            kind, payload = self._events.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited with code {self._process.exitcode} while starting") \
                from None
        if kind == "start_failed":
            self._process.join()
            raise payload
        return payload

    def stats(self) -> EngineStats:
        return self._stats

    def start(self, events: CoreEvents) -> None:
        self._reader = threading.Thread(target=self._read, args=(events,), name="nanovllm-engine-reader", daemon=True)
        self._reader.start()

    def post(self, command: tuple) -> None:
        if command[0] == "add":
            self._prompts[command[1]] = command[2]
        with self._send_lock:
            self._commands_in.send(command)

    def stop(self, timeout: float | None = None) -> None:
        """Let the engine process finish what it holds, then end it."""
        self._stopping = True
        try:
            with self._send_lock:
                self._commands_in.send(("stop",))
        except OSError:  # it is gone already
            pass
        self.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def kill(self) -> None:
        """End the engine process at once, if it still runs (a second signal, or a server that never
        started): it ignores SIGTERM, and the interpreter's exit would wait for it."""
        self._stopping = True
        if self._process.is_alive():
            self._process.kill()
        self._process.join()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reader to end (the engine process stopped, or broke)."""
        if self._reader is not None:
            self._reader.join(timeout)

    def _read(self, events: CoreEvents) -> None:
        try:
            while True:
                batch = self._events.recv()
                for event in batch:
                    if event[0] == "stopped":
                        return
                    self._dispatch(events, event)
        except (EOFError, OSError):
            if self._stopping:
                return
            self._process.join(5)
            events.fatal(RuntimeError(f"the engine process exited unexpectedly (exit code {self._process.exitcode})"))

    def _dispatch(self, events: CoreEvents, event: tuple) -> None:
        kind = event[0]
        if kind == "stepped":
            _, deltas, first_scheduled, started, stats = event
            self._stats = stats
            events.stepped([self._rebuild(delta) for delta in deltas], first_scheduled, started, stats)
        elif kind == "accepted":
            events.accepted(event[1])
        elif kind == "refused":
            self._prompts.pop(event[1], None)
            events.refused(event[1], event[2])
        elif kind == "failed":
            self._end(event[1])
            events.failed(event[1], event[2])
        elif kind == "released":
            self._end(event[1])
            events.released(event[1], event[2])
        else:  # "fatal"
            events.fatal(event[1])

    def _rebuild(self, delta: tuple) -> RequestOutput:
        """The cumulative output, as the engine made it, from the tokens that are new."""
        request_id, new_tokens, new_logprobs, finish_reason, metrics, prompt_logprobs = delta
        rebuilt = self._rebuilt.get(request_id)
        if rebuilt is None:
            rebuilt = self._rebuilt[request_id] = _Rebuilt(self._prompts[request_id], prompt_logprobs)
        rebuilt.token_ids += new_tokens
        if metrics is not None:
            rebuilt.metrics = metrics
        if new_logprobs is not None:
            rebuilt.logprobs = (rebuilt.logprobs or [])
            rebuilt.logprobs += new_logprobs
        logprobs = None if rebuilt.logprobs is None else list(rebuilt.logprobs)
        finished = finish_reason is not None
        if finished:
            self._end(request_id)
        completion = CompletionOutput(0, "", list(rebuilt.token_ids), finish_reason, logprobs)
        return RequestOutput(request_id, None, rebuilt.prompt_token_ids, [completion], finished, rebuilt.metrics,
                             rebuilt.prompt_logprobs)

    def _end(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self._rebuilt.pop(request_id, None)


@dataclass
class _Rebuilt:
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None  # the latest sent


class _PipeEvents:
    """CoreEvents in the engine process: buffered, sent as one message per loop iteration."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self._buffer: list[tuple] = []
        self._sent: dict[str, tuple[int, int, int]] = {}  # request id -> (tokens, logprobs, host bytes) sent

    def accepted(self, request_id: str) -> None:
        self._buffer.append(("accepted", request_id))

    def refused(self, request_id: str, error: Exception) -> None:
        self._buffer.append(("refused", request_id, _portable(error)))

    def failed(self, request_id: str, error: Exception) -> None:
        self._sent.pop(request_id, None)
        self._buffer.append(("failed", request_id, _portable(error)))

    def released(self, request_id: str, kind: str) -> None:
        self._sent.pop(request_id, None)
        self._buffer.append(("released", request_id, kind))

    def stepped(self, outputs: list[RequestOutput], first_scheduled: list[str], step_started: float,
                stats: EngineStats) -> None:
        deltas = [self._delta(out) for out in outputs]
        self._buffer.append(("stepped", deltas, first_scheduled, step_started, stats))
        self.flush()

    def fatal(self, error: BaseException) -> None:
        self._buffer.append(("fatal", RuntimeError(f"the engine failed: {error!r}")))
        self.flush()

    def stopped(self) -> None:
        self._buffer.append(("stopped",))
        self.flush()

    def flush(self) -> None:
        self.connection.send(self._buffer)
        self._buffer = []

    def _delta(self, out: RequestOutput) -> tuple:
        """(id, new tokens, their logprobs, finish reason, metrics, prompt logprobs). The metrics only when
        the front end reads them: first and last output, and when the host bytes grew (pickling one
        per output per step would cost the engine ~1.4 us each)."""
        completion, metrics = out.outputs[0], out.metrics
        sent = self._sent.get(out.request_id)
        tokens_sent, logprobs_sent, host_bytes = sent if sent is not None else (0, 0, -1)
        logprobs = completion.logprobs
        new_logprobs = None if logprobs is None else logprobs[logprobs_sent:]
        host_now = metrics.host_kv_bytes_read if metrics is not None else 0
        send_metrics = sent is None or out.finished or host_now != host_bytes
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (len(completion.token_ids), 0 if logprobs is None else len(logprobs), host_now)
        return (out.request_id, completion.token_ids[tokens_sent:], new_logprobs,
                completion.finish_reason if out.finished else None, metrics if send_metrics else None,
                out.prompt_logprobs if sent is None else None)


def _portable(error: BaseException) -> Exception:
    """The error itself if it crosses a pipe intact (ValueError, TypeError, RequestFailed), else its repr."""
    if type(error) in (ValueError, TypeError, RequestFailed):
        return error
    return RuntimeError(repr(error))


def _engine_process_main(model: str | None, options: dict, log_requests: bool, log_level: int,
                         commands: Connection, events: Connection) -> None:
    from nanovllm import request_log
    from nanovllm.log_setup import configure_logging
    from nanovllm.llm import LLM

    # Ctrl-C reaches the whole process group: the server drains and then stops this process over the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging()
    logging.getLogger("nanovllm").setLevel(log_level)
    request_log.enable(log_requests)
    try:
        engine = LLM(model, **options)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        events.send(("start_failed", e if type(e) in (ValueError, TypeError, FileNotFoundError) else
                     RuntimeError(f"the engine could not start: {e!r}")))
        return
    bm = engine.block_manager
    events.send(("started", {"config": engine.config, "pool": PoolLimits(bm.num_blocks, bm.num_host_blocks,
                                                                          bm.block_size), "stats": engine.stats()}))
    sink = _PipeEvents(events)
    loop = EngineLoop(engine, sink)
    threading.Thread(target=_receive_commands, args=(commands, loop), name="nanovllm-commands", daemon=True).start()
    loop.run()
    try:
        sink.stopped()
    except OSError:
        pass
    engine.shutdown()


def _receive_commands(commands: Connection, loop: EngineLoop) -> None:
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):  # the server process is gone: nobody waits for any output
            os._exit(0)
        if command[0] == "stop":
            loop.stop()
            return
        loop.post(command)
