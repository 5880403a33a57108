"""The front end's event loop and HTTP parser: uvloop and httptools where installed (as uvicorn[standard]),
asyncio and h11 otherwise or when asked; both parsers carry the server's header deadline (the deadline itself
is tested over HTTP with each parser in test_server_hardening.py); which requests are prepared on the event loop."""
from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("uvicorn")

from uvicorn.protocols.http.h11_impl import H11Protocol

from nanovllm.server import http
from nanovllm.server.app import ServerOptions, event_loop_name


def test_auto_takes_httptools_and_uvloop_where_installed(monkeypatch):
    assert http.http_parser("auto") == ("httptools" if importlib.util.find_spec("httptools") else "h11")
    assert http.http_parser("h11") == "h11" and http.http_parser("httptools") == "httptools"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # neither installed
    assert http.http_parser("auto") == "h11"
    assert event_loop_name("auto") == "asyncio" and event_loop_name("uvloop") == "uvloop"


def test_unknown_choices_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match="uvicorn_http must be one of auto, httptools, h11, got 'picohttp'"):
        ServerOptions(uvicorn_http="picohttp")
    with pytest.raises(ValueError, match="uvicorn_loop must be one of auto, uvloop, asyncio, got 'trio'"):
        ServerOptions(uvicorn_loop="trio")


def test_each_parser_protocol_carries_the_header_deadline():
    h11_class = http.with_header_timeout(2.5, "h11")
    assert issubclass(h11_class, H11Protocol) and issubclass(h11_class, http._HeaderDeadline)
    assert h11_class.timeout_headers == 2.5
    if importlib.util.find_spec("httptools") is None:
        pytest.skip("httptools is not installed")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    fast = http.with_header_timeout(3.0, "httptools")
    assert issubclass(fast, HttpToolsProtocol) and issubclass(fast, http._HeaderDeadline)
    assert fast.timeout_headers == 3.0 and "on_headers_complete" in vars(fast.__mro__[1])


def test_small_bodies_are_prepared_on_the_event_loop_and_larger_ones_on_the_pool():
    """A burst of small requests reaches the engine one by one as the loop takes them in (no pool round trip
    behind every other request's first steps); a body past INLINE_BODY_BYTES (a long text to tokenize) goes to the
    pool, so that it does not stall the streams of the others."""
    import asyncio
    import threading

    from nanovllm.server import preprocess

    prep = preprocess.Preprocessor.__new__(preprocess.Preprocessor)
    prep.pool = preprocess.ThreadPoolExecutor(1, thread_name_prefix="nanovllm-preprocess")
    prep._malloc_trim = None
    where = lambda raw: threading.current_thread().name  # noqa: E731

    async def both() -> tuple[str, str, str]:
        return (await prep.run(where, b"x" * preprocess.INLINE_BODY_BYTES), threading.current_thread().name,
                await prep.run(where, b"x" * (preprocess.INLINE_BODY_BYTES + 1)))

    small, loop_thread, large = asyncio.run(both())
    prep.close()
    assert small == loop_thread and large.startswith("nanovllm-preprocess"), (small, loop_thread, large)
