"""The server's front end of the engine: requests driven from asyncio, text made in an output thread.

The HTTP handlers never touch the engine: they post commands (add, abort) to the engine core
(server/engine_core.py: the engine loop in a thread of this process, or in a process of its own). The core
runs requests without detokenizing them and reports each step's token outputs here, from its thread (or the
thread reading its pipe); they go to the output thread, which turns them into text
(engine/detokenizer.OutputText: the same code as offline), checks stop strings (a match ends the request
in the engine with a "finish" command) and fills each request's RequestStream with
`loop.call_soon_threadsafe`. So the event loop never blocks on a forward pass and the engine never waits
for detokenization.

No request can end the engine loop: a request the engine refuses fails alone, and a step that raises
fails the requests of its batch (`StepFailed`) while the others go on. Only a broken engine (several
failed steps in a row, bookkeeping that no longer adds up, or its process gone) stops it: `error` is set,
every request fails with 503 and `on_fatal` is called (the server then exits non-zero).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nanovllm.engine.detokenizer import OutputText
from nanovllm.engine.llm_engine import EngineStats
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.server.engine_loop import CoreEvents, RequestFailed
from nanovllm.server.metrics import ServerMetrics

log = logging.getLogger("nanovllm.server")

_ACCEPTED = object()  # put on a request's stream once the engine accepted it


class EngineUnavailable(Exception):
    """The server cannot take the request now (queue full, shutting down, or the engine failed)."""

    def __init__(self, message: str, reason: str = "overloaded"):
        super().__init__(message)
        self.reason = reason


class EngineCore(Protocol):
    """Where the engine loop runs (engine_loop.ThreadCore or engine_core.EngineProcess)."""

    tokenizer: object

    def stats(self) -> EngineStats: ...

    def start(self, events: CoreEvents) -> None: ...

    def post(self, command: tuple) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


@dataclass
class _Track:
    """Per-request bookkeeping, updated by the thread that reports the engine's events."""

    stream: "RequestStream"
    loop: asyncio.AbstractEventLoop
    arrival: float  # time.monotonic()
    token_ids: list[int]
    params: SamplingParams
    accepted: bool = False
    last_token_time: float | None = None
    num_tokens: int = 0
    host_kv_bytes: int = 0  # host KV bytes read so far, as recorded in the metrics

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.stream.put, item)
        except RuntimeError:  # the event loop is closed: nobody waits for this request any more
            pass


@dataclass
class RequestStream:
    """The outputs of one request. Use `async with`; leaving early aborts the request and frees its KV.

    It holds only the newest item (each output holds the cumulative text): a consumer that falls behind gets
    every new token in its next output, one SSE chunk for several steps, as vLLM does."""

    request_id: str
    engine: "AsyncEngine"
    finished: bool = False
    closed: bool = field(default=False, repr=False)
    accepted: bool = field(default=False, repr=False)
    _item: RequestOutput | BaseException | None = field(default=None, repr=False)  # newest, not yet taken
    _waiter: asyncio.Future | None = field(default=None, repr=False)

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

    def put(self, item: RequestOutput | BaseException | object) -> None:
        """On the event loop: a new output (replacing one not yet taken, unless that one ends the request),
        an error, or _ACCEPTED."""
        if item is _ACCEPTED:
            self.accepted = True
        elif self._item is None or (isinstance(self._item, RequestOutput) and not self._item.finished):
            self._item = item
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def next(self) -> RequestOutput:
        """The newest output. Raises RequestFailed or EngineUnavailable if the request failed."""
        while self._item is None:
            await self._wait()
        item, self._item = self._item, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def admitted(self) -> None:
        """Wait until the engine accepted the request; raises its refusal."""
        while not self.accepted and self._item is None:
            await self._wait()
        if isinstance(self._item, BaseException):
            self.finished = True
            raise self._item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine._release(self.request_id, abort=not self.finished)


class AsyncEngine(CoreEvents):
    def __init__(self, core: EngineCore, metrics: ServerMetrics, max_pending_requests: int = 256,
                 on_fatal: Callable[[], None] | None = None):
        if max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        self.core = core
        self.metrics = metrics
        self.max_pending_requests = max_pending_requests
        self.on_fatal = on_fatal  # called once the engine is broken
        self.pending = 0  # changed only on the event loop
        self.draining = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}  # added on the event loop, ended by the engine's events
        self._outputs = OutputThread(core.tokenizer, metrics, self._post)
        self.metrics.set_stats(core.stats())

    # ---- event-loop side -----------------------------------------------------------------
    def start(self) -> None:
        self._outputs.start()
        self.core.start(self)

    def stop(self, timeout: float | None = None) -> None:
        """Let the engine finish what it holds, then end it and the output thread."""
        self.core.stop(timeout)
        self._outputs.stop(timeout)

    def check_available(self) -> None:
        """Raise EngineUnavailable if a request would be refused now (also checked by add_request)."""
        if self.error is not None:
            raise EngineUnavailable(f"the engine failed: {self.error!r}", "engine_error")
        if self.draining:
            raise EngineUnavailable("the server is shutting down", "shutting_down")
        if self.pending >= self.max_pending_requests:
            raise EngineUnavailable(f"the server is at its limit of max_pending_requests={self.max_pending_requests} "
                                    "requests in flight; retry later")

    async def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; raises ValueError/TypeError (refused by the engine) or EngineUnavailable."""
        self.check_available()
        self.pending += 1
        self.metrics.set_pending(self.pending)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self)
        track = _Track(stream, loop, time.monotonic(), token_ids, params)
        try:
            with self._lock:
                if self.error is None:
                    self._tracks[request_id] = track
            self._post(("add", request_id, token_ids, params))
            await stream.admitted()
        except BaseException:
            stream.close()  # cancelled while waiting for admission, refused, or the engine is gone
            raise
        return stream

    def _release(self, request_id: str, abort: bool) -> None:
        self.pending -= 1
        self.metrics.set_pending(self.pending)
        if abort:
            try:
                self._post(("abort", request_id))
            except EngineUnavailable:  # the engine is gone; it failed this request itself
                pass

    def _post(self, command: tuple) -> None:
        with self._lock:
            if self.error is not None:
                raise EngineUnavailable(f"the engine failed: {self.error!r}", "engine_error")
            try:
                self.core.post(command)
            except OSError as e:  # the engine process is gone; the thread reading its pipe reports it
                raise EngineUnavailable(f"the engine process is gone: {e!r}", "engine_error") from None

    # ---- the engine's events (CoreEvents), from the thread that reports them --------------
    def accepted(self, request_id: str) -> None:
        track = self._tracks.get(request_id)
        if track is None:  # failed by a broken engine meanwhile
            return
        track.accepted = True
        self._outputs.post(("start", request_id, track, track.token_ids, track.params))
        track.put(_ACCEPTED)

    def refused(self, request_id: str, error: Exception) -> None:
        track = self._tracks.pop(request_id, None)
        if track is not None:
            track.put(error)

    def stepped(self, outputs: list[RequestOutput], first_scheduled: list[str], step_started: float,
                stats: EngineStats) -> None:
        for request_id in first_scheduled:
            track = self._tracks.get(request_id)
            if track is not None:
                self.metrics.record_scheduled(max(0.0, step_started - track.arrival))
        if outputs:
            self._deliver(outputs, time.monotonic())
        self.metrics.set_stats(stats)

    def failed(self, request_id: str, error: Exception) -> None:
        self._tracks.pop(request_id, None)
        self._outputs.post(("fail", request_id, error))

    def released(self, request_id: str, kind: str) -> None:
        self._tracks.pop(request_id, None)
        if kind == "abort":  # else "finish": the output thread found a stop string and ended it already
            self._outputs.post(("abort", request_id))

    def fatal(self, error: BaseException) -> None:
        with self._lock:
            self.error = error
            tracks, self._tracks = self._tracks, {}
        unavailable = EngineUnavailable(f"the engine failed: {error!r}", "engine_error")
        for request_id, track in tracks.items():
            if track.accepted:
                self._outputs.post(("fail", request_id, unavailable))
            else:
                track.put(unavailable)
        if self.on_fatal is not None:
            self.on_fatal()

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        delivered = []
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            new_tokens = len(out.outputs[0].token_ids) - track.num_tokens
            if track.num_tokens == 0 and new_tokens > 0:
                cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
                self.metrics.record_first_token(len(out.prompt_token_ids), cached, now - track.arrival)
                self.metrics.record_tokens(new_tokens, None)
            elif new_tokens > 0:
                self.metrics.record_tokens(new_tokens, now - track.last_token_time)
            track.num_tokens += new_tokens
            track.last_token_time = now
            if out.metrics is not None:
                self.metrics.record_host_bytes(out.metrics.host_kv_bytes_read - track.host_kv_bytes)
                track.host_kv_bytes = max(track.host_kv_bytes, out.metrics.host_kv_bytes_read)
            delivered.append(out)
            if out.finished:
                del self._tracks[out.request_id]
        if delivered:
            self._outputs.post(("outputs", delivered))


@dataclass
class _Text:
    """The output thread's state of one request."""

    track: _Track
    text: OutputText | None  # None without a tokenizer: outputs carry token ids only
    num_tokens: int = 0  # tokens already turned into text


class OutputThread:
    """Turns the engine's token outputs into text, stop strings included, and hands them to the requests.

    Events, in the engine's order: ("start", id, track, prompt ids, params), ("outputs", [RequestOutput]) (one
    step's), ("abort", id), ("fail", id, exception). It posts ("finish", id) to the engine when a stop string
    ends a request, and records every request's end in the metrics (once: it alone knows whether it ended).
    What it hands to the requests goes to their event loop in one callback per batch of events, not one
    per request and step (each call_soon_threadsafe wakes the loop)."""

    MAX_BATCH = 64  # events handled before their outputs are handed over, however busy the queue

    def __init__(self, tokenizer, metrics: ServerMetrics, post_to_engine: Callable[[tuple], None]):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.post_to_engine = post_to_engine
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._texts: dict[str, _Text] = {}
        self._handed: list[tuple[_Track, object]] = []  # (track, item) not yet handed to the event loop
        self._thread = threading.Thread(target=self._run, name="nanovllm-detokenizer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._events.put(None)
        self._thread.join(timeout)

    def post(self, event: tuple) -> None:
        self._events.put(event)

    def _run(self) -> None:
        handled = 0
        while (event := self._events.get()) is not None:
            if event[0] == "outputs":
                for out in event[1]:
                    self._safely(self._output, out.request_id, out)
            else:
                self._safely(self._handle, event[1], event)
            handled += 1
            if handled >= self.MAX_BATCH or self._events.empty():
                self._hand_over()
                handled = 0

    def _safely(self, fn: Callable, request_id: str, arg) -> None:
        try:
            fn(request_id, arg)
        except Exception as e:  # noqa: BLE001 - one request's text must not stop the others'
            log.exception("turning request %s's tokens into text failed", request_id)
            self._end(request_id, "error", RequestFailed(f"turning the output into text failed: {e!r}"))
            self._post_quietly(("abort", request_id))

    def _handle(self, request_id: str, event: tuple) -> None:
        kind = event[0]
        if kind == "start":
            _, _, track, token_ids, params = event
            text = OutputText.for_params(self.tokenizer, token_ids, params) if self.tokenizer is not None else None
            self._texts[request_id] = _Text(track, text)
        elif kind == "abort":
            self._end(request_id, "abort", None)
        else:
            self._end(request_id, "error", event[2])

    def _hand(self, track: _Track, item) -> None:
        self._handed.append((track, item))

    def _hand_over(self) -> None:
        """One callback per event loop puts every pending item on its request's stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        for track, item in self._handed:
            by_loop.setdefault(track.loop, []).append((track.stream, item))
        self._handed = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: nobody waits for these requests any more
                pass

    def _output(self, request_id: str, out: RequestOutput) -> None:
        state = self._texts.get(request_id)
        if state is None:  # ended here already (a stop string) while the engine ran on
            return
        token_ids, reason = out.outputs[0].token_ids, out.outputs[0].finish_reason
        for i in range(state.num_tokens, len(token_ids)):
            state.num_tokens = i + 1
            if state.text is None:
                continue
            state.text.add(token_ids[i])
            engine_stopped_here = out.finished and reason == "stop" and i == len(token_ids) - 1  # EOS, stop id
            if state.text.stop and not engine_stopped_here and state.text.match_stop():
                if not out.finished:
                    self._post_quietly(("finish", request_id))
                self._end(request_id, "stop", _with_text(out, token_ids[: i + 1], state.text.text, "stop"))
                return
        if out.finished:
            text = state.text.final(token_ids) if state.text is not None else ""
            self._end(request_id, reason or "stop", _with_text(out, token_ids, text, reason))
        else:
            self._hand(state.track, _with_text(out, token_ids, state.text.text if state.text is not None else "", None))

    def _end(self, request_id: str, reason: str, item: RequestOutput | Exception | None) -> None:
        state = self._texts.pop(request_id, None)
        if state is None:
            return
        self.metrics.record_finished(reason, time.monotonic() - state.track.arrival)
        if item is not None:
            self._hand(state.track, item)

    def _post_quietly(self, command: tuple) -> None:
        try:
            self.post_to_engine(command)
        except EngineUnavailable:  # the engine is gone and fails every request itself
            pass


def _put_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.put(item)


def _with_text(out: RequestOutput, token_ids: Sequence[int], text: str, finish_reason: str | None) -> RequestOutput:
    done = finish_reason is not None
    logprobs = out.outputs[0].logprobs
    if logprobs is not None and len(logprobs) != len(token_ids):  # a stop string ended it early
        logprobs = logprobs[: len(token_ids)]
    completion = CompletionOutput(0, text, token_ids, finish_reason, logprobs)
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, [completion], done, out.metrics,
                         out.prompt_logprobs)
