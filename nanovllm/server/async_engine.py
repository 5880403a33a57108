"""One engine loop in a background thread, driven from asyncio.

The HTTP handlers never touch the engine: they post commands (add, abort) to a queue under a lock and
receive outputs on a per-request asyncio.Queue, filled from the engine thread with
`loop.call_soon_threadsafe`. The engine thread is the only caller of add_request, abort_request and
step(), so the event loop never blocks on a forward pass.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.server.metrics import ServerMetrics

_ACCEPTED = object()  # first item on a request's queue once add_request succeeded


class EngineUnavailable(Exception):
    """The server cannot take the request now (queue full, shutting down, or the engine failed)."""

    def __init__(self, message: str, reason: str = "overloaded"):
        super().__init__(message)
        self.reason = reason


@dataclass
class _Track:
    """Per-request bookkeeping, owned by the engine thread after submission."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class RequestStream:
    """The outputs of one request. Use `async with`; leaving early aborts the request and frees its KV."""

    request_id: str
    engine: "AsyncEngine"
    queue: asyncio.Queue
    finished: bool = False
    closed: bool = field(default=False, repr=False)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        while not self.finished:
            out = await self.next()
            yield out

    async def next(self) -> RequestOutput:
        """The newest output; a slow consumer skips intermediate ones (each holds the cumulative text)."""
        item = await self.queue.get()
        while not self.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine._release(self.request_id, abort=not self.finished)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_pending_requests: int = 256):
        if max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        self.engine = engine
        self.metrics = metrics
        self.max_pending_requests = max_pending_requests
        self.pending = 0  # changed only on the event loop
        self.draining = False
        self.error: BaseException | None = None
        self._commands: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._tracks: dict[str, _Track] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self.metrics.set_stats(engine.stats())

    # ---- event-loop side -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Let the engine thread finish what it holds, then end it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; raises ValueError (refused by the engine) or EngineUnavailable."""
        if self.error is not None:
            raise EngineUnavailable(f"the engine failed: {self.error!r}", "engine_error")
        if self.draining:
            raise EngineUnavailable("the server is shutting down", "shutting_down")
        if self.pending >= self.max_pending_requests:
            raise EngineUnavailable(f"the server is at its limit of max_pending_requests={self.max_pending_requests} "
                                    "requests in flight; retry later")
        self.pending += 1
        self.metrics.set_pending(self.pending)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, asyncio.Queue())
        self._post(("add", request_id, prompt, params, _Track(stream.queue, loop, time.perf_counter())))
        try:
            item = await stream.queue.get()
        except BaseException:
            stream.close()  # cancelled while waiting for admission
            raise
        if isinstance(item, BaseException):
            stream.finished = True
            stream.close()
            raise item
        return stream

    def _release(self, request_id: str, abort: bool) -> None:
        self.pending -= 1
        self.metrics.set_pending(self.pending)
        if abort:
            self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._next_commands() is not None or self.engine.has_unfinished_requests():
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step(), time.perf_counter())
                self.metrics.set_stats(self.engine.stats())
        except BaseException as e:  # a failed step fails every request; the server stays up to report it
            self.error = e
            for track in self._tracks.values():
                track.put(EngineUnavailable(f"the engine failed: {e!r}", "engine_error"))
            self._tracks.clear()
            raise

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
        if command[0] == "add":
            _, request_id, prompt, params, track = command
            try:
                self.engine.add_request(prompt, params, request_id)
            except ValueError as e:
                track.put(e)
                return
            self._tracks[request_id] = track
            track.put(_ACCEPTED)
        else:
            request_id = command[1]
            track = self._tracks.pop(request_id, None)
            if track is not None:  # still in the engine: free its blocks
                self.engine.abort_request(request_id)
                self.metrics.record_finished("abort", time.perf_counter() - track.arrival)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            new_tokens = len(out.outputs[0].token_ids) - track.num_tokens
            if track.num_tokens == 0 and new_tokens > 0:
                self.metrics.record_first_token(len(out.prompt_token_ids), now - track.arrival)
                self.metrics.record_tokens(new_tokens, None)
            elif new_tokens > 0:
                self.metrics.record_tokens(new_tokens, now - track.last_token_time)
            track.num_tokens += new_tokens
            track.last_token_time = now
            track.put(out)
            if out.finished:
                del self._tracks[out.request_id]
                self.metrics.record_finished(out.outputs[0].finish_reason or "stop", now - track.arrival)
