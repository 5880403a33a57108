"""The OpenAI-compatible HTTP front end (Starlette on uvicorn) over one AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming), GET /v1/models and
/v1/models/{id}, POST /tokenize and /detokenize, GET /version, /health and /metrics (Prometheus text). A
completion request with several prompts, or n > 1, runs one engine request per prompt and choice. With an
API key, every route but /health, /metrics and /version needs it; CORS only for --allowed-origins.
SIGTERM/SIGINT: new requests get 503 while the requests in flight finish, then the engine loop stops and
the process exits; a second signal exits at once. If the engine breaks, /health says so and the process
exits with status 1, for a supervisor to restart it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import jinja2
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nanovllm.engine import gc_watch
from nanovllm.llm import LLM
from nanovllm.outputs import RequestOutput
from nanovllm.server import protocol as p
from nanovllm.server import UVICORN_LOOPS
from nanovllm.server import responses as r
from nanovllm.server.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from nanovllm.server.engine_core import CoreClient
from nanovllm.server.engine_loop import RequestFailed, ThreadCore
from nanovllm.server.http import (APIKeyMiddleware, EventStream, FrontEndHeader, http_parser, read_json_body,
                                  with_header_timeout)
from nanovllm.server.metrics import CONTENT_TYPE, ServerMetrics
from nanovllm.server.preprocess import PreparedRequest, Preprocessor, refusal

log = logging.getLogger("nanovllm.server")

API_KEY_ENV = "NANOVLLM_API_KEY"
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ServerOptions:
    served_model_name: str | None = None  # default: the model directory's name
    max_pending_requests: int = 256
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS; none by default
    max_request_body_bytes: int = 32 * 1024 * 1024
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection is closed after this
    timeout_request_read: float = 30.0  # request line + headers, then the body, must each arrive within this
    chat_template: str | None = None  # a Jinja template replacing the model's own (--chat-template)
    api_server_count: int = 1  # front-end processes over one engine process (server/api_servers.py)
    uvicorn_loop: str = "auto"  # uvicorn's event loop: auto (uvloop where installed), uvloop or asyncio
    uvicorn_http: str = "auto"  # uvicorn's HTTP parser: auto (httptools where installed), httptools or h11

    def __post_init__(self):
        check_api_server_count(self.api_server_count)
        if self.uvicorn_loop not in UVICORN_LOOPS:
            raise ValueError(f"uvicorn_loop must be one of {', '.join(UVICORN_LOOPS)}, got {self.uvicorn_loop!r}")
        http_parser(self.uvicorn_http)


def check_api_server_count(count: int, engine_core: str = "process") -> None:
    """--api-server-count: an int >= 1; more than one front end needs the engine in a process of its own."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"api_server_count must be an int >= 1, got {count!r}")
    if count > 1 and engine_core != "process":
        raise ValueError(f"api_server_count={count} needs --engine-core process (the front-end processes share "
                         f"one engine process), got --engine-core {engine_core}")


def error_response(e: p.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class OpenAIServer:
    """The routes over one engine: an LLM (its loop then runs in a thread of this process) or a CoreClient of
    an engine process (an EngineProcess of this front end's own, or one shared by several front ends)."""

    def __init__(self, llm: LLM | CoreClient, options: ServerOptions = ServerOptions()):
        self.llm = llm
        self.options = options
        self.model_name = options.served_model_name or Path(llm.config.model).name
        self.metrics = ServerMetrics(self.model_name)
        core = llm if isinstance(llm, CoreClient) else ThreadCore(llm)
        self.engine = AsyncEngine(core, self.metrics, options.max_pending_requests)
        self.preprocessor = Preprocessor(llm, (self.model_name,), options.chat_template)
        self.token_texts = r.TokenTexts(llm.tokenizer)
        middleware = []
        if options.allowed_origins:
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                                         allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
        if options.api_key is not None:
            middleware.append(Middleware(APIKeyMiddleware, api_key=options.api_key))
        if options.api_server_count > 1:
            middleware.append(Middleware(FrontEndHeader))
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model_card, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            middleware=middleware,
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine.start()
        yield
        self.engine.stop()
        self.preprocessor.close()

    # ---- simple routes -------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(self.engine.error)}, status_code=503)
        if self.engine.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            return error_response(p.model_not_found(model_id, (self.model_name,)))
        return JSONResponse(self._card())

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": r.now(), "owned_by": "nanovllm",
                "root": self.model_name, "max_model_len": self.llm.config.max_model_len}

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": nanovllm_version()})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        return error_response(p.APIError(exc.status_code, str(exc.detail), None, None, "invalid_request_error"))

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("internal error")
        return error_response(p.APIError(500, f"internal error: {exc!r}", None, None, "internal_error"))

    # ---- tokenizer routes ----------------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, self.preprocessor.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, self.preprocessor.detokenize)

    async def _tokenizer_route(self, request: Request, fn) -> Response:
        try:
            raw = await read_json_body(request, self.options.max_request_body_bytes, self.options.timeout_request_read)
            return JSONResponse(await self.preprocessor.run(fn, raw))
        except p.APIError as e:
            return error_response(e)

    # ---- generation ----------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        rid = r.new_id(chat)
        try:
            self._check_available()  # before reading and tokenizing a request that would be refused
            raw = await read_json_body(request, self.options.max_request_body_bytes, self.options.timeout_request_read)
            prepared = await self.preprocessor.prepare(raw, chat)
            del raw  # a large body is not kept while the request runs
            streams = await self._admit_all(prepared, rid)
        except p.APIError as e:
            self.metrics.record_rejected("overloaded" if e.status in (429, 503) else "invalid")
            return error_response(e)
        choices = r.Choices(prepared, chat, self.token_texts)
        if prepared.parsed.stream:
            return EventStream(self._sse(streams, choices, rid))
        async with _all(streams):
            try:
                outs = await _until_finished_or_disconnect(streams, request)
            except (RequestFailed, EngineUnavailable) as e:
                return error_response(_stream_error(e))
        if outs is None:  # the client went away; the request was aborted
            return Response(status_code=499)
        return JSONResponse(r.body(rid, prepared.parsed.model, chat, choices.final(outs), choices.usage(outs), r.now()))

    def _check_available(self) -> None:
        try:
            self.engine.check_available()
        except EngineUnavailable as e:
            raise p.APIError(503, str(e), None, e.reason, "server_error") from None

    async def _admit_all(self, prepared: PreparedRequest, rid: str) -> list[RequestStream]:
        """One engine request per prompt and per choice (n), all admitted or none."""
        n = prepared.parsed.n
        wanted = len(prepared.prompts) * n
        if wanted > self.engine.max_pending_requests:
            raise p.APIError(400, f"the request asks for {wanted} completions (prompts x n) but this server runs at "
                                  f"most max_pending_requests={self.engine.max_pending_requests} at once",
                             "n" if n > 1 else prepared.prompt_field)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prepared.prompts):
                for j in range(n):
                    params = prompt.params if j == 0 or prompt.params.seed is None else \
                        dataclasses.replace(prompt.params, seed=(prompt.params.seed + j) % 2**63)
                    streams.append(await self._admit(prompt.token_ids, params, f"{rid}-{i * n + j}",
                                                     prepared.prompt_field))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    async def _admit(self, token_ids: list[int], params, rid: str, prompt_field: str) -> RequestStream:
        try:
            return await self.engine.add_request(token_ids, params, rid)
        except EngineUnavailable as e:
            raise p.APIError(503, str(e), None, e.reason, "server_error") from None
        except (ValueError, TypeError) as e:  # the engine's own limits: max_model_len, KV pool size, vocab
            raise refusal(e, prompt_field) from None
        except RequestFailed as e:
            raise _stream_error(e) from None

    async def _sse(self, streams: list[RequestStream], choices: r.Choices, rid: str) -> AsyncIterator[bytes]:
        created, model, chat = r.now(), choices.parsed.model, choices.chat
        chunk_event = r.ChunkEvents(rid, model, created, chat)
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with _all(streams):
            if chat:
                for index in range(len(streams)):
                    yield r.event(r.chunk(rid, model, created, True, index, None, None, role=True))
            try:
                async for index, out in _merged(streams):
                    finals[index] = out
                    delta, finish, logprobs, new_tokens = choices.delta(index, out)
                    if delta or finish or logprobs or new_tokens:
                        yield chunk_event(index, delta, finish, logprobs)
            except (RequestFailed, EngineUnavailable) as e:  # as vLLM: an error event, then the end of the stream
                yield r.event(_stream_error(e).body())
                yield DONE
                return
        if choices.parsed.include_usage and all(out is not None for out in finals):
            yield r.event(r.usage_chunk(rid, model, created, chat, choices.usage(finals)))
        yield DONE


@contextlib.asynccontextmanager
async def _all(streams: list[RequestStream]):
    """Every stream closed on leaving (aborting the unfinished ones)."""
    try:
        yield streams
    finally:
        for stream in streams:
            stream.close()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) in arrival order until every stream finished; raises a stream's failure."""
    if len(streams) == 1:  # the common case, without a task per output
        while not streams[0].finished:
            yield 0, await streams[0].next()
        return
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                yield i, task.result()
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in pending:
            task.cancel()


def _stream_error(e: Exception) -> p.APIError:
    if isinstance(e, EngineUnavailable):
        return p.APIError(503, str(e), None, e.reason, "server_error")
    return p.APIError(500, str(e), None, "request_failed", "server_error")


async def _until_finished_or_disconnect(streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
    """The final outputs, or None if the client disconnected first; raises if a request failed."""

    async def final() -> list[RequestOutput]:
        outs: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in _merged(streams):
            outs[i] = out
        return outs

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done_task, gone_task = asyncio.ensure_future(final()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        done_task.cancel()
        raise
    finally:
        gone_task.cancel()
    if not done_task.done():  # the client went first (cancelling does not make the task done at once)
        done_task.cancel()
        return None
    return done_task.result()


# The engine thread (--engine-core thread), and the thread reading the engine process's pipe, drop the GIL at
# every wait and must get it back at once; with a busy event loop holding it, each such hand-back waits out
# the interpreter's switch interval (5 ms by default).
SWITCH_INTERVAL_S = 0.0005


def serve(llm: LLM | CoreClient, host: str, port: int, options: ServerOptions = ServerOptions(),
          log_level: str = "info", shutdown_timeout: float | None = None, sock: socket.socket | None = None) -> None:
    """Run the server until SIGTERM/SIGINT, then drain the requests in flight. Exits with status 1 if the
    engine broke. With `sock` (one of several front ends, server/api_servers.py): serve on that listening
    socket and leave SIGINT to the parent, which turns it into a SIGTERM to each front end."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = OpenAIServer(llm, options)
    parser = http_parser(options.uvicorn_http)
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on", loop=options.uvicorn_loop,
                            http=with_header_timeout(options.timeout_request_read, parser),
                            timeout_keep_alive=options.timeout_keep_alive)
    uvicorn_server = _DrainingServer(config, server.engine, handles_sigint=sock is None)
    log.info("front end %d: %s event loop, %s HTTP parser", os.getpid(), event_loop_name(options.uvicorn_loop), parser)
    server.engine.on_fatal = lambda: setattr(uvicorn_server, "should_exit", True)
    gc_watch.freeze_start_up_heap()  # a full collection would stall every stream for its walk over ~460K objects
    gc_watch.watch()  # with --engine-core thread the engine's process is this one (its stats' gc_seconds)
    try:
        uvicorn_server.run(sockets=None if sock is None else [sock])
    finally:  # after a drain the engine has stopped already; after a second signal it must not be waited for
        server.engine.core.kill()
    if server.engine.error is not None:
        print(f"error: the engine failed: {server.engine.error!r}", file=sys.stderr)
        sys.exit(1)


def event_loop_name(choice: str) -> str:
    """The loop uvicorn runs for --uvicorn-loop: auto is uvloop where it is installed."""
    if choice != "auto":
        return choice
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def nanovllm_version() -> str:
    try:
        return importlib.metadata.version("nanovllm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the template itself; a file name that does not exist is an error."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        value = path.read_text()
    elif "{{" not in value and "{%" not in value:
        raise FileNotFoundError(f"--chat-template: no such file {value!r} (and not a Jinja template)")
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from None
    return value


def api_key_from(option: str | None) -> str | None:
    """--api-key, else $NANOVLLM_API_KEY, else None (no key); an empty key is refused."""
    key = option if option is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key:
        raise ValueError(f"the API key (--api-key or ${API_KEY_ENV}) must not be empty")
    return key


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: the first signal turns new generation requests (and /health) into 503;
    a second one exits without waiting (a front end of several ignores SIGINT: Ctrl-C reaches every
    process, and the parent sends each front end a SIGTERM); after the drain the process exits with
    status 0 (uvicorn would raise the signal again, and Ctrl-C would end in a KeyboardInterrupt traceback
    and status 1)."""

    def __init__(self, config, engine: AsyncEngine, handles_sigint: bool = True):
        super().__init__(config)
        self.engine = engine
        self.handles_sigint = handles_sigint

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and not self.handles_sigint:
            return
        self.engine.draining = True
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                getattr(self, "_captured_signals", []).clear()  # uvicorn 0.40's list of signals to raise again
