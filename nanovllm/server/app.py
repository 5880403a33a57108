"""The OpenAI-compatible HTTP front end (Starlette on uvicorn) over one AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming), GET /v1/models,
GET /health, GET /metrics (Prometheus text). With an API key, every route but /health and /metrics needs
it; CORS only for --allowed-origins. SIGTERM/SIGINT: new requests get 503 while the requests in flight
finish, then the engine thread stops and the process exits; a second signal exits at once. If the engine
breaks, /health says so and the process exits with status 1, for a supervisor to restart it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nanovllm.llm import LLM
from nanovllm.outputs import RequestOutput
from nanovllm.server import protocol as p
from nanovllm.server.async_engine import AsyncEngine, EngineUnavailable, RequestFailed, RequestStream
from nanovllm.server.http import APIKeyMiddleware, read_json_body, with_header_timeout
from nanovllm.server.metrics import ServerMetrics
from nanovllm.server.preprocess import Preprocessor, refusal

log = logging.getLogger("nanovllm.server")

API_KEY_ENV = "NANOVLLM_API_KEY"


@dataclass(frozen=True)
class ServerOptions:
    served_model_name: str | None = None  # default: the model directory's name
    max_pending_requests: int = 256
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS; none by default
    max_request_body_bytes: int = 32 * 1024 * 1024
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection is closed after this
    timeout_request_read: float = 30.0  # request line + headers, then the body, must each arrive within this


def error_response(e: p.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class OpenAIServer:
    def __init__(self, llm: LLM, options: ServerOptions = ServerOptions()):
        self.llm = llm
        self.options = options
        self.model_name = options.served_model_name or Path(llm.config.model).name
        self.metrics = ServerMetrics(self.model_name)
        self.engine = AsyncEngine(llm, self.metrics, options.max_pending_requests)
        self.preprocessor = Preprocessor(llm, (self.model_name,))
        middleware = []
        if options.allowed_origins:
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                                         allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
        if options.api_key is not None:
            middleware.append(Middleware(APIKeyMiddleware, api_key=options.api_key))
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
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
        card = {"id": self.model_name, "object": "model", "created": p.now(), "owned_by": "nanovllm",
                "root": self.model_name, "max_model_len": self.llm.config.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def prometheus(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        return error_response(p.APIError(exc.status_code, str(exc.detail), None, None, "invalid_request_error"))

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("internal error")
        return error_response(p.APIError(500, f"internal error: {exc!r}", None, None, "internal_error"))

    # ---- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        rid = p.new_id(chat)
        try:
            self._check_available()  # before reading and tokenizing a request that would be refused
            raw = await read_json_body(request, self.options.max_request_body_bytes, self.options.timeout_request_read)
            prepared = await self.preprocessor.prepare(raw, chat)
            del raw  # a large body is not kept while the request runs
            stream = await self._admit(prepared.token_ids, prepared.parsed.params, rid, prepared.prompt_field)
        except p.APIError as e:
            self.metrics.record_rejected("overloaded" if e.status in (429, 503) else "invalid")
            return error_response(e)
        parsed = prepared.parsed
        if parsed.stream:
            return StreamingResponse(self._sse(stream, parsed, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async with stream:
            try:
                out = await _until_finished_or_disconnect(stream, request)
            except (RequestFailed, EngineUnavailable) as e:
                return error_response(_stream_error(e))
        if out is None:  # the client went away; the request was aborted
            return Response(status_code=499)
        usage = p.usage(len(out.prompt_token_ids), len(out.token_ids))
        make = p.chat_body if chat else p.completion_body
        return JSONResponse(make(rid, parsed.model, out.text, out.finish_reason, usage, p.now()))

    def _check_available(self) -> None:
        try:
            self.engine.check_available()
        except EngineUnavailable as e:
            raise p.APIError(503, str(e), None, e.reason, "server_error") from None

    async def _admit(self, token_ids: list[int], params, rid: str, prompt_field: str) -> RequestStream:
        try:
            return await self.engine.add_request(token_ids, params, rid)
        except EngineUnavailable as e:
            raise p.APIError(503, str(e), None, e.reason, "server_error") from None
        except (ValueError, TypeError) as e:  # the engine's own limits: max_model_len, KV pool size, vocab
            raise refusal(e, prompt_field) from None
        except RequestFailed as e:
            raise _stream_error(e) from None

    async def _sse(self, stream: RequestStream, parsed: p.ParsedRequest, rid: str, chat: bool) -> AsyncIterator[str]:
        created, model = p.now(), parsed.model
        # Hold back the tail that could be the start of a stop string, so text cut by a stop never reaches the client.
        hold = max((len(s) for s in parsed.params.stop), default=1) - 1
        sent, out = "", None
        async with stream:
            if chat:
                yield _event(p.chunk(rid, model, created, True, None, None, role=True))
            try:
                async for out in stream:
                    text = out.text if out.finished else out.text[: max(0, len(out.text) - hold)]
                    delta = text[len(sent):] if text.startswith(sent) else ""
                    sent = text if text.startswith(sent) else sent
                    yield _event(p.chunk(rid, model, created, chat, delta, out.finish_reason if out.finished else None))
            except (RequestFailed, EngineUnavailable) as e:  # as vLLM: an error event, then the end of the stream
                yield _event(_stream_error(e).body())
                yield "data: [DONE]\n\n"
                return
        if parsed.include_usage and out is not None:
            yield _event(p.usage_chunk(rid, model, created, chat, p.usage(len(out.prompt_token_ids), len(out.token_ids))))
        yield "data: [DONE]\n\n"


def _stream_error(e: Exception) -> p.APIError:
    if isinstance(e, EngineUnavailable):
        return p.APIError(503, str(e), None, e.reason, "server_error")
    return p.APIError(500, str(e), None, "request_failed", "server_error")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _until_finished_or_disconnect(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The final output, or None if the client disconnected first; raises if the request failed."""

    async def final() -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

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


def serve(llm: LLM, host: str, port: int, options: ServerOptions = ServerOptions(), log_level: str = "info",
          shutdown_timeout: float | None = None) -> None:
    """Run the server until SIGTERM/SIGINT, then drain the requests in flight. Exits with status 1 if the
    engine broke."""
    server = OpenAIServer(llm, options)
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on",
                            http=with_header_timeout(options.timeout_request_read),
                            timeout_keep_alive=options.timeout_keep_alive)
    uvicorn_server = _DrainingServer(config, server.engine)
    server.engine.on_fatal = lambda: setattr(uvicorn_server, "should_exit", True)
    uvicorn_server.run()
    if server.engine.error is not None:
        print(f"error: the engine failed: {server.engine.error!r}", file=sys.stderr)
        sys.exit(1)


def api_key_from(option: str | None) -> str | None:
    """--api-key, else $NANOVLLM_API_KEY, else None (no key); an empty key is refused."""
    key = option if option is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key:
        raise ValueError(f"the API key (--api-key or ${API_KEY_ENV}) must not be empty")
    return key


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: the first signal turns new generation requests (and /health) into 503;
    a second one exits without waiting."""

    def __init__(self, config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.draining = True
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)
