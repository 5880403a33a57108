"""The OpenAI-compatible HTTP front end (Starlette on uvicorn) over one AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming), GET /v1/models,
GET /health, GET /metrics (Prometheus text). SIGTERM/SIGINT: new requests get 503 while the requests in
flight finish, then the engine thread stops and the process exits.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nanovllm.llm import LLM
from nanovllm.outputs import RequestOutput
from nanovllm.server import protocol as p
from nanovllm.server.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from nanovllm.server.metrics import ServerMetrics

log = logging.getLogger("nanovllm.server")


def error_response(e: p.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class OpenAIServer:
    def __init__(self, llm: LLM, served_model_name: str | None = None, max_pending_requests: int = 256):
        self.llm = llm
        self.model_name = served_model_name or Path(llm.config.model).name
        self.served_names = (self.model_name, llm.config.model)
        self.metrics = ServerMetrics(self.model_name)
        self.engine = AsyncEngine(llm, self.metrics, max_pending_requests)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine.start()
        yield
        self.engine.stop()

    # ---- simple routes -------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(self.engine.error)}, status_code=503)
        if self.engine.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        card = {"id": self.model_name, "object": "model", "created": p.now(), "owned_by": "nanovllm",
                "root": self.llm.config.model, "max_model_len": self.llm.config.max_model_len}
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
            parsed, prompt = self._parse(await request.body(), chat)
            stream = await self._admit(prompt, parsed.params, rid, "messages" if chat else "prompt")
        except p.APIError as e:
            self.metrics.record_rejected("overloaded" if e.status in (429, 503) else "invalid")
            return error_response(e)
        if parsed.stream:
            return StreamingResponse(self._sse(stream, parsed, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async with stream:
            out = await _until_finished_or_disconnect(stream, request)
        if out is None:  # the client went away; the request was aborted
            return Response(status_code=499)
        usage = p.usage(len(out.prompt_token_ids), len(out.token_ids))
        make = p.chat_body if chat else p.completion_body
        return JSONResponse(make(rid, parsed.model, out.text, out.finish_reason, usage, p.now()))

    def _parse(self, raw: bytes, chat: bool) -> tuple[p.ParsedRequest, str | list[int]]:
        body = p.parse_json(raw)
        if not chat:
            parsed = p.parse_completion(body, self.served_names)
            return parsed, parsed.prompt
        parsed = p.parse_chat(body, self.served_names)
        prompt = self._chat_prompt(parsed.messages)
        if not parsed.max_tokens_given:  # as in vLLM: the rest of the context window
            room = max(1, self.llm.config.max_model_len - len(prompt))
            parsed.params = dataclasses.replace(parsed.params, max_tokens=room)
        return parsed, prompt

    def _chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if self.llm.tokenizer is None or not getattr(self.llm.tokenizer, "chat_template", None):
            raise p.APIError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            return self.llm.chat_prompt(messages)  # the same template call as LLM.chat
        except Exception as e:  # noqa: BLE001 - the template itself rejects some conversations
            raise p.APIError(400, f"the chat template rejected the messages: {e}", "messages") from None

    async def _admit(self, prompt, params, rid: str, prompt_field: str) -> RequestStream:
        try:
            return await self.engine.add_request(prompt, params, rid)
        except EngineUnavailable as e:
            raise p.APIError(503, str(e), None, e.reason, "server_error") from None
        except ValueError as e:  # the engine's own limits: max_model_len, KV pool size, vocab
            code = "context_length_exceeded" if "max_model_len" in str(e) or "KV blocks" in str(e) else None
            raise p.APIError(400, str(e), prompt_field, code) from None

    async def _sse(self, stream: RequestStream, parsed: p.ParsedRequest, rid: str, chat: bool) -> AsyncIterator[str]:
        created, model = p.now(), parsed.model
        # Hold back the tail that could be the start of a stop string, so text cut by a stop never reaches the client.
        hold = max((len(s) for s in parsed.params.stop), default=1) - 1
        sent, out = "", None
        async with stream:
            if chat:
                yield _event(p.chunk(rid, model, created, True, None, None, role=True))
            async for out in stream:
                text = out.text if out.finished else out.text[: max(0, len(out.text) - hold)]
                delta = text[len(sent):] if text.startswith(sent) else ""
                sent = text if text.startswith(sent) else sent
                yield _event(p.chunk(rid, model, created, chat, delta, out.finish_reason if out.finished else None))
        if parsed.include_usage and out is not None:
            yield _event(p.usage_chunk(rid, model, created, chat, p.usage(len(out.prompt_token_ids), len(out.token_ids))))
        yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _until_finished_or_disconnect(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The final output, or None if the client disconnected first."""

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
    finally:
        gone_task.cancel()
        if not done_task.done():
            done_task.cancel()
    return done_task.result() if not done_task.cancelled() else None


def serve(llm: LLM, host: str, port: int, served_model_name: str | None = None, max_pending_requests: int = 256,
          log_level: str = "info", shutdown_timeout: float | None = None) -> None:
    """Run the server until SIGTERM/SIGINT, then drain the requests in flight."""
    server = OpenAIServer(llm, served_model_name, max_pending_requests)
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    _DrainingServer(config, server.engine).run()


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: the first signal turns new generation requests (and /health) into 503."""

    def __init__(self, config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.draining = True
        super().handle_exit(sig, frame)
