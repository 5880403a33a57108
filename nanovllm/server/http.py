"""What the server asks of a client before a request reaches the engine.

- `APIKeyMiddleware`: `Authorization: Bearer <key>` on every route but /health, /metrics and /version, compared in
  constant time; 401 with OpenAI's error body otherwise.
- `read_json_body`: a JSON content type (else 415: a browser page may send text/plain cross-origin
  without asking, but not application/json), at most `limit` bytes (else 413), all of it within
  `timeout` seconds (else 408).
- `EventStream`: a text/event-stream response of byte chunks, sent straight to the ASGI server.
- `FrontEndHeader`: `X-Nanovllm-Frontend: <pid>` on every response, with several front-end processes
  (--api-server-count): which one served it.
- `with_header_timeout`: uvicorn's protocol (httptools where installed, else h11), plus a deadline for a
  request's line and headers (uvicorn has only the keep-alive timeout, so a client sending headers byte by
  byte held a connection forever).
"""
from __future__ import annotations

import asyncio
import hmac
import importlib.util
import os
from collections.abc import AsyncIterator

import h11
from starlette.requests import Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanovllm.server import HTTP_PARSERS
from nanovllm.server.protocol import APIError

OPEN_PATHS = ("/health", "/metrics", "/version")


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self.expected = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                         None, "invalid_api_key")
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


class FrontEndHeader:
    """Adds `X-Nanovllm-Frontend: <this process's pid>` to every HTTP response."""

    def __init__(self, app):
        self.app = app
        self.header = (b"x-nanovllm-frontend", str(os.getpid()).encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def is_json_content_type(value: str | None) -> bool:
    media_type = (value or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


async def read_json_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body; APIError 415, 413 or 408 as the module docstring says."""
    content_type = request.headers.get("content-type")
    if not is_json_content_type(content_type):
        raise APIError(415, f"the request body must be JSON with 'Content-Type: application/json', got "
                            f"{content_type!r}", None, "unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", None, "request_timeout") from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the server's limit of {limit} bytes "
                         "(--max-request-body-bytes)", None, "request_too_large")


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class EventStream:
    """An SSE response: each chunk of `chunks` is sent as it comes; a client that goes away cancels the
    sending task (and so the generator, which aborts its requests). Starlette's StreamingResponse does the
    same through an anyio task group and a str-to-bytes step per response."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        self.chunks = chunks
        self.gone = False  # the client disconnected before the stream ended

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(receive, asyncio.current_task()))
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.gone:  # cancelled from elsewhere (the server stops)
                raise
            asyncio.current_task().uncancel()
        finally:
            watcher.cancel()
            await self.chunks.aclose()

    async def _cancel_on_disconnect(self, receive, sender: asyncio.Task) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not sender.done():
            self.gone = True
            sender.cancel()


class _HeaderDeadline:
    """Closes a connection whose next request line and headers are not complete `timeout_headers` seconds
    after the connection became ready for it (opened, or the previous response sent). A mixin over uvicorn's
    protocol classes; a subclass cancels the deadline where its parser completes a request's headers."""

    timeout_headers: float = 30.0  # set per server by a subclass (see with_header_timeout)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline = None
        self._start_header_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._start_header_deadline()  # before super(): it may start on a pipelined request at once
        super().on_response_complete()

    def _start_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.timeout_headers, self._headers_too_slow)

    def _cancel_header_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        self._say_closing()
        self.transport.close()

    def _say_closing(self) -> None:
        pass


class H11HeaderTimeout(_HeaderDeadline, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the header deadline."""

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a request's headers are in
            self._cancel_header_deadline()

    def _say_closing(self) -> None:
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass


def _httptools_header_timeout() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeout(_HeaderDeadline, HttpToolsProtocol):
        """uvicorn's httptools protocol (llhttp, C) with the header deadline."""

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._cancel_header_deadline()

    return HttpToolsHeaderTimeout


def http_parser(choice: str) -> str:
    """--uvicorn-http: auto is httptools where it is installed (about a quarter less CPU per streamed token
    with uvloop, docs/BENCHMARKS.md), else h11."""
    if choice not in HTTP_PARSERS:
        raise ValueError(f"uvicorn_http must be one of {', '.join(HTTP_PARSERS)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


def with_header_timeout(seconds: float, parser: str = "h11") -> type:
    """The protocol class for uvicorn.Config(http=...): `parser`'s (httptools or h11), with this server's
    header deadline."""
    base = _httptools_header_timeout() if parser == "httptools" else H11HeaderTimeout
    return type(base.__name__, (base,), {"timeout_headers": seconds})
