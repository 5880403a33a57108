"""The server's engine loop (server/engine_loop.py) in a process of its own, apart from its HTTP front end.

`EngineProcess`: the loop in a child process, as vLLM's EngineCore; the default of `nanovllm serve` (`ThreadCore`,
in engine_loop.py, keeps it in a thread of the server process). The engine's Python then never waits for the GIL
that the event loop and the detokenizer hold, each step's outputs cross a pipe as token deltas, and an engine
process that dies is reported like a broken engine.

One engine process can serve several front-end processes (`nanovllm serve --api-server-count N`,
server/api_servers.py): `SharedCore` starts it with one pair of pipes per front end, and each front end talks
to it through a `CoreClient` over its own pair. The engine process waits on every front end's commands
(`_receive_commands`), names front end k's requests "k:<id>" in the engine, and sends each request's events
back to the front end that sent it (`_FrontEnds`). A front end that goes away has its requests aborted (their
KV freed); the others go on.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from nanovllm.config import EngineConfig
from nanovllm.engine import gc_watch
from nanovllm.engine.llm_engine import EngineStats, LLMEngine
from nanovllm.engine.model_files import load_tokenizer
from nanovllm.engine.request_state import RequestState
from nanovllm.engine.sequence import PLACEHOLDER
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.server.engine_loop import CoreEvents, EngineLoop, RequestFailed
from nanovllm.server.prefix import Prefix

log = logging.getLogger("nanovllm.server")

@dataclass(frozen=True)
class PoolLimits:
    """What check_request reads of the block manager, sent over from the engine process."""

    num_blocks: int
    num_host_blocks: int
    block_size: int

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class CoreStart:
    """What the engine process sends once its engine is built."""

    config: EngineConfig
    pool: PoolLimits
    stats: EngineStats
    frozen_objects: int  # the start-up heap kept out of the garbage collector's reach (gc_watch)
    torch_threads: int  # torch's CPU threads in the engine process (intra_op_threads)


Link = tuple[Connection, Connection]  # a front end's (commands it sends, events it receives)


def spawn_core(model: str | None, options: dict, log_requests: bool,
               count: int) -> tuple[BaseProcess, list[Link], CoreStart]:
    """Start an engine process for `count` front ends and wait until its engine is built: the process, one
    Link per front end, and what it sent. Raises what LLM(...) raised there."""
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; the child imports afresh
    ours: list[Link] = []
    theirs: list[Link] = []
    for _ in range(count):
        commands_out, commands_in = context.Pipe(duplex=False)
        events_out, events_in = context.Pipe(duplex=False)
        ours.append((commands_in, events_out))
        theirs.append((commands_out, events_in))
    process = context.Process(target=_engine_process_main, name="nanovllm-engine-core", args=(
        model, options, log_requests, logging.getLogger("nanovllm").getEffectiveLevel(), theirs))
    process.start()
    for connection in (c for link in theirs for c in link):
        connection.close()
    return process, ours, _receive_start(process, ours[0][1])


def _receive_start(process: BaseProcess, events: Connection) -> CoreStart:
    try:
        kind, payload = events.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting") from None
    if kind == "start_failed":
        process.join()
        raise payload
    return payload


class CoreClient:
    """A front end's side of an engine process: its commands out, its requests' events in. It has what the front
    end reads of an engine: config, tokenizer, tokenize(), check_request() (the same code as LLMEngine's, over
    the pool's sizes). It does not own the process: an EngineProcess does, or the parent of the front ends."""

    tokenize = LLMEngine.tokenize
    check_request = LLMEngine.check_request

    def __init__(self, link: Link, start: CoreStart):
        self._commands_in, self._events = link
        # commands go out through a thread of their own, several to a message: a burst of requests fills the pipe
        # faster than the engine process reads it, and a blocking write would stall the event loop meanwhile
        self._outbox: list[tuple] = []
        self._outbox_cond = threading.Condition()
        self._send_error: OSError | None = None
        self._writer = threading.Thread(target=self._write, name="nanovllm-engine-writer", daemon=True)
        self._writer.start()
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._prompts: dict[str, list[int]] = {}
        self._rebuilt: dict[str, _Rebuilt] = {}
        self.config: EngineConfig = start.config
        self.block_manager = start.pool
        self._stats: EngineStats = start.stats
        self.frozen_objects = start.frozen_objects
        self.torch_threads = start.torch_threads
        self.tokenizer = load_tokenizer(Path(self.config.model_path))

    def stats(self) -> EngineStats:
        return self._stats

    def start(self, events: CoreEvents) -> None:
        self._reader = threading.Thread(target=self._read, args=(events,), name="nanovllm-engine-reader", daemon=True)
        self._reader.start()

    def post(self, command: tuple) -> None:
        """Queue a command for the engine process (in order); OSError once its pipe has broken."""
        if command[0] == "add":
            self._prompts[command[1]] = command[2]
        with self._outbox_cond:
            if self._send_error is not None:
                raise self._send_error
            self._outbox.append(command)
            self._outbox_cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Tell the engine process this front end is done (after the commands queued before), and wait for its
        answer. The last front end to stop lets the engine finish what it holds, then end; before that, its
        requests are aborted."""
        self._stopping = True
        try:
            self.post(("stop",))
        except OSError:  # it is gone already
            pass
        self._writer.join(timeout)
        self.join(timeout)

    def _write(self) -> None:
        """Send what is queued, as one list per message, until a "stop" went out or the pipe broke."""
        while True:
            with self._outbox_cond:
                while not self._outbox:
                    self._outbox_cond.wait()
                commands, self._outbox = self._outbox, []
            try:
                self._commands_in.send(commands)
            except OSError as e:  # the engine process is gone: the reader reports it; posts raise from now on
                with self._outbox_cond:
                    self._send_error = e
                return
            if commands[-1][0] == "stop":
                return

    def kill(self) -> None:
        """Stop reporting the engine's end: this front end goes (the engine process is not its own)."""
        self._stopping = True

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reader to end (the engine process stopped, or broke)."""
        if self._reader is not None:
            self._reader.join(timeout)

    def _gone(self) -> str:
        return "the engine process exited unexpectedly"

    def _read(self, events: CoreEvents) -> None:
        try:
            while True:
                batch = self._events.recv()
                for event in batch:
                    if event[0] == "stopped":
                        return
                    self._dispatch(events, event)
        except (EOFError, OSError, TypeError) as e:
            # a connection closed under recv() raises TypeError (its handle is None): the same end as EOF
            if isinstance(e, TypeError) and not self._events.closed:
                raise
            if self._stopping:
                return
            events.fatal(RuntimeError(self._gone()))

    def _dispatch(self, events: CoreEvents, event: tuple) -> None:
        kind = event[0]
        if kind == "stepped":
            _, ids, tokens, deltas, first_scheduled, started, stats = event
            self._stats = stats
            outputs = [self._rebuild((request_id, [token], None, None, None, None))
                       for request_id, token in zip(ids, tokens)]
            outputs += [self._rebuild(delta) for delta in deltas]
            events.stepped(outputs, first_scheduled, started, stats)
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
        """The cumulative output, as the engine made it, from the tokens that are new (its token ids and logprobs
        `Prefix`es of the lists this request's steps append to: no copy per step)."""
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
        logprobs = None if rebuilt.logprobs is None else Prefix(rebuilt.logprobs)
        finished = finish_reason is not None
        if finished:
            self._end(request_id)
        completion = CompletionOutput(0, "", Prefix(rebuilt.token_ids), finish_reason, logprobs)
        return RequestOutput(request_id, None, rebuilt.prompt_token_ids, [completion], finished, rebuilt.metrics,
                             rebuilt.prompt_logprobs)

    def _end(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self._rebuilt.pop(request_id, None)




class EngineProcess(CoreClient):
    """An LLM built and run in a child process, for this process's front end alone. Options are LLM(...)'s;
    bad ones raise here as they would there."""

    def __init__(self, model: str | None = None, log_requests: bool = False, **options: Any):
        self._process, links, start = spawn_core(model, options, log_requests, 1)
        super().__init__(links[0], start)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def stop(self, timeout: float | None = None) -> None:
        """Let the engine process finish what it holds, then end it."""
        super().stop(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def kill(self) -> None:
        """End the engine process at once, if it still runs (a second signal, or a server that never
        started): it ignores SIGTERM, and the interpreter's exit would wait for it."""
        super().kill()
        if self._process.is_alive():
            self._process.kill()
        self._process.join()

    def _gone(self) -> str:
        self._process.join(5)
        return f"the engine process exited unexpectedly (exit code {self._process.exitcode})"


class SharedCore:
    """An engine process for `count` front-end processes (server/api_servers.py): one Link each, handed over
    by the caller, which then closes its own copies (`release_links`). The engine process ends once every
    front end stopped or went away."""

    def __init__(self, model: str | None, count: int, log_requests: bool = False, **options: Any):
        self.process, self.links, self.start = spawn_core(model, options, log_requests, count)

    def release_links(self) -> None:
        """Close this process's copies of the front ends' connections (after handing them over)."""
        for connection in (c for link in self.links for c in link):
            connection.close()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine process to end; kill it if it has not after `timeout`."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@dataclass
class _Rebuilt:
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None  # the latest sent


class _PipeEvents:
    """One front end's CoreEvents in the engine process: buffered per loop iteration, then written to the pipe by a
    thread of their own, so that a front end slow to read (busy streaming) never stalls the engine loop; what
    piles up meanwhile goes as one message. Request ids lose the front end's prefix of `skip` characters on the
    way. A front end gone quietly drops its events."""

    def __init__(self, connection: Connection, skip: int):
        self.connection = connection
        self.skip = skip
        self.closed = False
        self._buffer: list[tuple] = []
        self._sent: dict[str, list[int]] = {}  # request id -> [tokens, logprobs, host bytes] sent
        self._cond = threading.Condition()  # guards the outbox, `closed` and `_closing`
        self._outbox: list[tuple] = []  # flushed, not yet written
        self._writing = False  # the writer holds events taken from the outbox
        self._closing = False
        self._writer = threading.Thread(target=self._write, name="nanovllm-events", daemon=True)
        self._writer.start()

    def accepted(self, request_id: str) -> None:
        self._buffer.append(("accepted", request_id[self.skip:]))

    def refused(self, request_id: str, error: Exception) -> None:
        self._buffer.append(("refused", request_id[self.skip:], _portable(error)))

    def failed(self, request_id: str, error: Exception) -> None:
        self._sent.pop(request_id, None)
        self._buffer.append(("failed", request_id[self.skip:], _portable(error)))

    def released(self, request_id: str, kind: str) -> None:
        self._sent.pop(request_id, None)
        self._buffer.append(("released", request_id[self.skip:], kind))

    def stepped(self, outputs: list[RequestState], first_scheduled: list[str], step_started: float,
                stats: EngineStats) -> None:
        """Requests with one new token and nothing else to report go as two flat lists (ids, tokens), the others
        as deltas: per row and step the common case costs a third of a delta's work and pickled bytes."""
        ids, tokens, deltas = [], [], []
        sent_of, skip = self._sent.get, self.skip
        for state in outputs:
            request_id, samples = state.request_id, state.samples
            sent = sent_of(request_id)
            if sent is not None and len(samples) == 1:
                seq = samples[0].seq
                token_ids = seq.token_ids
                end = len(token_ids) - (token_ids[-1] == PLACEHOLDER)
                if end - seq.num_prompt_tokens == sent[0] + 1 and seq.finish_reason is None \
                        and seq.params.logprobs is None and seq.host_kv_bytes_read == sent[2]:
                    sent[0] += 1
                    ids.append(request_id[skip:])
                    tokens.append(token_ids[end - 1])
                    continue
            deltas.append(self._delta(state))
        first = [request_id[skip:] for request_id in first_scheduled]
        self._buffer.append(("stepped", ids, tokens, deltas, first, step_started, stats))
        self.flush()

    def fatal(self, error: BaseException) -> None:
        self._buffer.append(("fatal", RuntimeError(f"the engine failed: {error!r}")))
        self.flush(wait=True)

    def stopped(self) -> None:
        self._buffer.append(("stopped",))
        self.flush(wait=True)

    def flush(self, wait: bool = False) -> None:
        """Hand the buffer to the writer; wait: until it is written (the process is about to end)."""
        buffer, self._buffer = self._buffer, []
        with self._cond:
            if self.closed:
                return
            self._outbox += buffer
            self._cond.notify_all()
            while wait and (self._outbox or self._writing) and not self.closed:
                self._cond.wait()

    def close(self, last_words: list[tuple]) -> None:
        """Write what is pending and `last_words` (unless gone), then nothing more."""
        with self._cond:
            if not self.closed:
                self._outbox += last_words
            self._closing = True
            self._cond.notify_all()
        self._writer.join()
        self.connection.close()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._outbox and not self._closing:
                    self._cond.wait()
                events, self._outbox = self._outbox, []
                if not events:  # closing and nothing left
                    self.closed = True
                    self._cond.notify_all()
                    return
                self._writing = True
            try:
                self.connection.send(events)
            except Exception as e:  # noqa: BLE001 - OSError: the front end is gone (the thread receiving its
                if not isinstance(e, OSError):  # commands aborts its requests); else a bug: nothing more is sent
                    log.exception("events to a front end could not be sent; it hears nothing more")
                with self._cond:
                    self.closed, self._outbox = True, []
                    self._cond.notify_all()
                return
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _delta(self, state: RequestState) -> tuple:
        """(id, new tokens, their logprobs, finish reason, metrics, prompt logprobs) of the request's first
        sample, read from its sequence. The metrics only when the front end reads them: first and last
        output, and when the host bytes grew (pickling one per output per step would cost the engine ~1.4 us
        each)."""
        seq, request_id, finished = state.seq, state.request_id, state.finished
        sent = self._sent.get(request_id)
        tokens_sent, logprobs_sent, host_bytes = sent if sent is not None else (0, 0, -1)
        token_ids = seq.token_ids
        end = len(token_ids) - (token_ids[-1] == PLACEHOLDER)  # the next token, launched but not here (async)
        new_tokens = token_ids[seq.num_prompt_tokens + tokens_sent : end]
        new_logprobs = None if seq.params.logprobs is None else seq.logprobs[logprobs_sent:]
        host_now = seq.host_kv_bytes_read
        send_metrics = sent is None or finished or host_now != host_bytes
        if finished:
            self._sent.pop(request_id, None)
        else:
            self._sent[request_id] = [end - seq.num_prompt_tokens, len(seq.logprobs), host_now]
        return (request_id[self.skip:], new_tokens, new_logprobs, seq.finish_reason if finished else None,
                state.metrics() if send_metrics else None, state.prompt_logprobs() if sent is None else None)


class _FrontEnds:
    """The engine loop's CoreEvents over every front end: each request's events go to the front end that sent it.
    Front end k's request ids are "k:<id>" in the engine (unchanged with a single front end)."""

    def __init__(self, events: list[Connection]):
        prefixes = [f"{k}:" if len(events) > 1 else "" for k in range(len(events))]
        self.sinks = [_PipeEvents(connection, len(prefix)) for connection, prefix in zip(events, prefixes)]
        self.prefixes = dict(zip(self.sinks, prefixes))
        self._owner: dict[str, _PipeEvents] = {}  # engine request id -> its front end, from "add" to its end

    def command(self, sink: _PipeEvents, command: tuple) -> tuple:
        """A front end's command, its request id made the engine's."""
        request_id = self.prefixes[sink] + command[1]
        if command[0] == "add":
            self._owner[request_id] = sink
        return (command[0], request_id, *command[2:])

    def requests_of(self, sink: _PipeEvents) -> list[str]:
        return [request_id for request_id, owner in list(self._owner.items()) if owner is sink]

    def accepted(self, request_id: str) -> None:
        self._owner[request_id].accepted(request_id)

    def refused(self, request_id: str, error: Exception) -> None:
        self._owner.pop(request_id).refused(request_id, error)

    def failed(self, request_id: str, error: Exception) -> None:
        self._owner.pop(request_id).failed(request_id, error)

    def released(self, request_id: str, kind: str) -> None:
        self._owner.pop(request_id).released(request_id, kind)

    def stepped(self, outputs: list[RequestState], first_scheduled: list[str], step_started: float,
                stats: EngineStats) -> None:
        """Every front end hears of every step (its engine gauges), with its own requests' outputs."""
        if len(self.sinks) == 1:
            self._forget_finished(outputs)
            self.sinks[0].stepped(outputs, first_scheduled, step_started, stats)
            return
        mine: dict[_PipeEvents, list[RequestState]] = {sink: [] for sink in self.sinks}
        for out in outputs:
            mine[self._owner[out.request_id]].append(out)
        firsts: dict[_PipeEvents, list[str]] = {sink: [] for sink in self.sinks}
        for request_id in first_scheduled:
            owner = self._owner.get(request_id)
            if owner is not None:
                firsts[owner].append(request_id)
        self._forget_finished(outputs)
        for sink in self.sinks:
            sink.stepped(mine[sink], firsts[sink], step_started, stats)

    def _forget_finished(self, outputs: list[RequestState]) -> None:
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)

    def fatal(self, error: BaseException) -> None:
        for sink in self.sinks:
            sink.fatal(error)

    def stopped(self) -> None:
        for sink in self.sinks:
            sink.stopped()


def _portable(error: BaseException) -> Exception:
    """The error itself if it crosses a pipe intact (ValueError, TypeError, RequestFailed), else its repr."""
    if type(error) in (ValueError, TypeError, RequestFailed):
        return error
    return RuntimeError(repr(error))


def name_process(name: str) -> None:
    """The name `ps` and `top` show for this process (Linux; at most 15 characters), where it can be set."""
    try:
        Path("/proc/self/comm").write_text(name)
    except OSError:
        pass


def _engine_process_main(model: str | None, options: dict, log_requests: bool, log_level: int,
                         links: list[Link]) -> None:
    from nanovllm import request_log
    from nanovllm.log_setup import configure_logging
    from nanovllm.llm import LLM

    # Ctrl-C reaches the whole process group: the server drains and then stops this process over the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name_process("nanovllm-core")
    configure_logging()
    logging.getLogger("nanovllm").setLevel(log_level)
    request_log.enable(log_requests)
    first_events = links[0][1]
    try:
        engine = LLM(model, **options)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        first_events.send(("start_failed", e if type(e) in (ValueError, TypeError, FileNotFoundError) else
                           RuntimeError(f"the engine could not start: {e!r}")))
        return
    threads = intra_op_threads(engine.runner.worker.device.type, os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
    frozen = gc_watch.freeze_start_up_heap()
    gc_watch.watch()
    bm = engine.block_manager
    first_events.send(("started", CoreStart(engine.config, PoolLimits(bm.num_blocks, bm.num_host_blocks, bm.block_size),
                                            engine.stats(), frozen, torch.get_num_threads())))
    front_ends = _FrontEnds([events for _, events in links])
    loop = EngineLoop(engine, front_ends, build_outputs=False)
    commands = {connection: sink for (connection, _), sink in zip(links, front_ends.sinks)}
    threading.Thread(target=_receive_commands, args=(commands, front_ends, loop), name="nanovllm-commands",
                     daemon=True).start()
    loop.run()
    front_ends.stopped()
    engine.shutdown()
    if loop.failed:  # the parent of several front ends reads the exit status (api_servers.Supervisor)
        sys.exit(1)


def intra_op_threads(device_type: str, environ) -> int | None:
    """torch's CPU threads for the engine process: one where the model runs on a GPU and the user set no
    OMP_NUM_THREADS (as vLLM's worker processes). Its host ops are small there, and a pool of threads (one per
    core) waits at each parallel region for any thread that lost its core to the front ends' and clients'
    processes: on the CPU, with the kernels stubbed out, the engine loop's forward passes took 2x the offline
    engine's host time with two threads and the same with one (docs/BENCHMARKS.md). None: leave torch's default
    (a CPU model needs its threads for its compute)."""
    if device_type != "cuda" or "OMP_NUM_THREADS" in environ:
        return None
    return 1


def _receive_commands(commands: dict[Connection, _PipeEvents], front_ends: _FrontEnds, loop: EngineLoop) -> None:
    """Every front end's commands, as they come. A front end that stops, or goes away, leaves: the last one to
    stop lets the loop finish what it holds and end; one that leaves before has its requests aborted."""
    while commands:
        for connection in wait(list(commands)):
            try:
                batch = connection.recv()  # a front end's commands, in order, several to a message
            except (EOFError, OSError):
                batch = [None]
            sink = commands[connection]
            loop.post_many([front_ends.command(sink, c) for c in batch if c is not None and c[0] != "stop"])
            command = batch[-1]  # "stop" comes last, and nothing after it
            if command is not None and command[0] != "stop":
                continue
            del commands[connection]
            if not commands and command is not None:
                loop.stop()
                return
            if not commands:  # every front end is gone: nobody waits for any output
                os._exit(0)
            _leave(sink, front_ends, loop, stopped=command is not None)


def _leave(sink: _PipeEvents, front_ends: _FrontEnds, loop: EngineLoop, stopped: bool) -> None:
    """A front end leaves while others stay: its requests are aborted (their KV freed), its events end."""
    requests = front_ends.requests_of(sink)
    if requests:
        log.warning("a front end %s with %d requests in flight; aborting them", "stopped" if stopped else "went away",
                    len(requests))
    for request_id in requests:
        loop.post(("abort", request_id))
    sink.close([("stopped",)] if stopped else [])
