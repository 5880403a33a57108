"""The server against hostile clients: API key, content type, CORS, body size, slow clients, strict types,
and a hypothesis fuzz over request bodies. SmolLM2 on the CPU, one server for the module."""
from __future__ import annotations

import json
import signal
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")
pytest.importorskip("pydantic")  # the server extra; a bare GPU image may lack it

from nanovllm.server.protocol import ChatRequest, CompletionRequest
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
ORIGIN = "https://allowed.example"
BODY_LIMIT = 65536
READ_TIMEOUT = 2.0
GREEDY = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    args = ["--num-gpu-blocks", "64", "--allowed-origins", ORIGIN, "--max-request-body-bytes", str(BODY_LIMIT),
            "--timeout-request-read", str(READ_TIMEOUT), "--timeout-keep-alive", "1"]
    srv = ServerProcess(smollm2_path, args, log, env={"NANOVLLM_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def h11_server(smollm2_path, tmp_path_factory):
    """The same limits over uvicorn's pure-Python h11 parser (the module's server takes httptools where installed)."""
    log = tmp_path_factory.mktemp("hardening_h11") / "server.log"
    args = ["--num-gpu-blocks", "16", "--timeout-request-read", str(READ_TIMEOUT), "--timeout-keep-alive", "1",
            "--uvicorn-http", "h11", "--uvicorn-loop", "asyncio"]
    srv = ServerProcess(smollm2_path, args, log, env={"NANOVLLM_API_KEY": KEY})
    yield srv
    srv.stop()


PARSERS = ["server", "h11_server"]


@pytest.fixture(scope="module")
def greedy_text(server) -> str:
    response = post(server, "/v1/completions", GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def post(server, path: str, body, headers: dict | None = None, raw: bool = False) -> httpx.Response:
    content = body if raw else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=AUTH if headers is None else headers, timeout=60)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] == param and error["code"] == code, error
    return error


# ---- API key, content type, CORS, limits --------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {"Content-Type": "application/json"},
    {"Content-Type": "application/json", "Authorization": "Bearer wrong"},
    {"Content-Type": "application/json", "Authorization": KEY},
    {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}x"},
])
def test_generation_needs_the_api_key(server, headers):
    response = post(server, "/v1/completions", GREEDY, headers=headers)
    assert_openai_error(response, 401, code="invalid_api_key")
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_health_and_metrics_are_open_and_models_need_the_key(server, greedy_text):
    lowercase = {**AUTH, "Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    assert post(server, "/v1/completions", GREEDY, headers=lowercase).json()["choices"][0]["text"] == greedy_text
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "nanovllm:num_requests_running" in httpx.get(f"{server.url}/metrics").text
    assert httpx.get(f"{server.url}/version").status_code == 200
    for path in ("/v1/models/smollm2", "/tokenize", "/detokenize"):
        assert (httpx.get if "models" in path else httpx.post)(f"{server.url}{path}").status_code == 401
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == ["smollm2"] and models[0]["root"] == "smollm2"
    assert greedy_text


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_bodies_without_a_json_content_type_get_415(server, content_type):
    headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
    response = post(server, "/v1/completions", GREEDY, headers=headers)
    assert_openai_error(response, 415, code="unsupported_media_type")


def test_json_content_type_with_parameters_is_accepted(server, greedy_text):
    headers = {**AUTH, "Content-Type": "Application/JSON; charset=utf-8"}
    assert post(server, "/v1/completions", GREEDY, headers=headers).json()["choices"][0]["text"] == greedy_text


def test_cors_only_for_the_allowed_origin(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{server.url}/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server.url}/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = post(server, "/v1/completions", GREEDY, headers={**AUTH, "Origin": "https://evil.example"})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_body_over_the_limit_gets_413(server):
    big = {"prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    assert_openai_error(post(server, "/v1/completions", big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024

    chunked = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert_openai_error(chunked, 413, code="request_too_large")


def raw_connection(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if it stays open longer."""
    sock.settimeout(seconds)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


@pytest.mark.parametrize("parser", PARSERS)
def test_slow_headers_are_cut_off(parser, request):
    server = request.getfixturevalue(parser)
    with raw_connection(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while time.monotonic() - started < 4 * READ_TIMEOUT:  # one header line per half second, forever
                sock.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.5)
            pytest.fail("a client sending headers byte by byte held the connection")
    with raw_connection(server) as sock:  # connected and silent
        started = time.monotonic()
        assert closed_within(sock, 4 * READ_TIMEOUT) == b""
        assert time.monotonic() - started >= READ_TIMEOUT - 0.5


@pytest.mark.parametrize("parser", PARSERS)
def test_slow_body_gets_408(parser, request):
    server = request.getfixturevalue(parser)
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        reply = closed_within(sock, 4 * READ_TIMEOUT)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply


@pytest.mark.parametrize("parser", PARSERS)
def test_idle_keep_alive_connection_is_closed(parser, request):
    server = request.getfixturevalue(parser)
    with raw_connection(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = closed_within(sock, 5)
    assert reply.startswith(b"HTTP/1.1 200") and b'"ok"' in reply


# ---- strict types and numeric edges over HTTP ---------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x\ud800y", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2},
     "messages[0].content"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["\ud800"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 10**400}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": True}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": 0}, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2**63], "max_tokens": 2}, "prompt"),
])
def test_bad_values_get_400_naming_the_field(server, path, body, param):
    body = json.dumps(body)  # ensure_ascii: lone surrogates travel as \\ud800 escapes, as a hostile client sends them
    assert_openai_error(post(server, path, body, raw=True), 400, param)


def test_an_unknown_field_is_ignored_whatever_its_name(server, greedy_text):
    body = json.dumps({**GREEDY, "\ud800": 1, "x" * 100: {"y": [1]}})  # a lone surrogate as a name, escaped
    response = post(server, "/v1/completions", body, raw=True)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy_text
    assert f"ignored unknown fields '{'x' * 100}', '\\ud800'" in server.log_path.read_text()


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "hi", "temperature": NaN}', "NaN is not a JSON value"),
    (b'{"prompt": "hi", "temperature": -Infinity}', "-Infinity is not a JSON value"),
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature must be a finite number"),
    (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b"[" * 30000 + b"]" * 30000, "nests deeper than 64 levels"),
    (b'{"prompt": ' + b"[" * 70 + b"]" * 70 + b"}", "nests deeper than 64 levels"),
    (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
    (b"", "not valid JSON"),
    (b"null", "must be a JSON object"),
])
def test_malformed_bodies_get_400(server, raw, message):
    error = assert_openai_error(post(server, "/v1/completions", raw, raw=True), 400,
                                "temperature" if "temperature must" in message else None,
                                None if "temperature must" in message else "invalid_json")
    assert message in error["message"]


def test_huge_integer_temperature_and_tiny_temperature(server, greedy_text):
    huge = post(server, "/v1/completions", {**GREEDY, "temperature": 2**63, "seed": 1})
    assert huge.status_code == 200 and huge.json()["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    tiny = post(server, "/v1/completions", {**GREEDY, "temperature": 1e-300})
    assert tiny.json()["choices"][0]["text"] == greedy_text  # below 1e-5: greedy, as in vLLM
    edge = post(server, "/v1/completions", {**GREEDY, "temperature": 1.0, "seed": 2**63 - 1})
    assert edge.status_code == 200


def test_max_tokens_past_the_context_is_refused(server):
    response = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 255})
    error = assert_openai_error(response, 400, "max_tokens", "context_length_exceeded")
    assert "max_tokens=255" in error["message"] and "the prompt has 5 tokens" in error["message"]
    assert "max_model_len=256" in error["message"] and "at most 251" in error["message"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_completion_tokens": 10**6})
    assert_openai_error(chat, 400, "max_tokens", "context_length_exceeded")
    fits = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 251,
                                            "stop": ["The", " ", "."], "temperature": 0})
    assert fits.status_code == 200  # prompt + max_tokens == max_model_len is allowed


# ---- the fuzz ------------------------------------------------------------------------------------------------

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)  # hypothesis' characters() never yields these
TEXT = st.text(st.characters(), max_size=12) | st.text(st.one_of(st.characters(), SURROGATES), max_size=12)
INTS = st.one_of(st.integers(-3, 300), st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63),
                                                        -(2**63) - 1, 10**30, -(10**30)]))
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.5, 1.0, 2.0, 1e308, -1e308]))
JSON = st.recursive(st.none() | st.booleans() | INTS | FLOATS | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
NONE_OR_JSON = st.none() | JSON
PLAUSIBLE = {  # per field: values a client might send, the accepted ones among them
    "model": st.just("smollm2") | TEXT,
    "prompt": st.one_of(st.text(min_size=1, max_size=12), TEXT, st.lists(st.integers(0, 49151), min_size=1, max_size=8),
                        st.lists(INTS, max_size=4), st.lists(TEXT, min_size=1, max_size=2)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                                "content": TEXT | st.lists(st.fixed_dictionaries(
                                                    {"type": st.just("text"), "text": TEXT}), max_size=2)}),
                         max_size=3),
    "temperature": FLOATS | INTS, "top_p": FLOATS | INTS, "min_p": FLOATS, "top_k": INTS, "seed": INTS,
    "stop": TEXT | st.lists(TEXT, max_size=5), "stop_token_ids": st.lists(INTS, max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "n": st.sampled_from([1, 2, 0, -1, 129, 2**63, True]), "logprobs": st.sampled_from([None, False]) | INTS,
    "echo": st.booleans(), "best_of": st.just(1) | INTS, "suffix": NONE_OR_JSON, "top_logprobs": st.just(0) | INTS,
    "presence_penalty": st.just(0) | FLOATS, "frequency_penalty": st.just(0) | FLOATS,
    "logit_bias": st.just({}) | st.dictionaries(TEXT, INTS, max_size=2), "user": TEXT, "tools": NONE_OR_JSON,
    "tool_choice": NONE_OR_JSON, "response_format": NONE_OR_JSON, "parallel_tool_calls": NONE_OR_JSON,
    "prompt_logprobs": st.sampled_from([None, 0, 1, 20, 21, -1]), "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(), "chat_template_kwargs": st.dictionaries(TEXT, JSON, max_size=2),
    "min_tokens": st.just(0) | INTS, "repetition_penalty": st.just(1.0) | FLOATS,
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
# Always present and never null, so a valid request generates one or two tokens, not a context's worth.
MAX_TOKENS = st.one_of(st.integers(1, 2), st.integers(1, 2),
                       st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64, 1.5, "2", True, [], {}]))


@st.composite
def request_bodies(draw, chat: bool) -> dict:
    def value(name: str):
        return draw(JSON) if draw(st.integers(0, 4)) == 4 else draw(PLAUSIBLE[name])  # mostly plausible

    body = {"messages": value("messages")} if chat else {"prompt": value("prompt")}
    body["max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"] = draw(MAX_TOKENS)
    known = set((ChatRequest if chat else CompletionRequest).model_fields) & set(PLAUSIBLE)
    fields = known - {"prompt", "messages", "max_tokens", "max_completion_tokens"}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = value(name)
    if draw(st.integers(0, 9)) == 9:  # (hypothesis draws the simplest value, 0, most often)
        body[draw(TEXT)] = draw(JSON)  # an unknown field
    return body


def assert_well_formed(response: httpx.Response, body: dict) -> int:
    """The response's status, once it is a 2xx with a complete completion or a 4xx with OpenAI's error body."""
    assert response.status_code < 500, (body, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], (body, error)
        assert isinstance(error["type"], str), (body, error)
        assert error["param"] is None or isinstance(error["param"], str), (body, error)
        assert error["code"] is None or isinstance(error["code"], str), (body, error)
        return response.status_code
    assert response.status_code == 200, (body, response.status_code)
    if body.get("stream") is True:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), (body, events)
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length"), (body, response.text)
    return response.status_code


FUZZ = settings(max_examples=200, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_get_2xx_or_an_openai_4xx(server, greedy_text, path):
    chat = path.endswith("chat/completions")
    statuses: list[int] = []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:

        @FUZZ
        @given(request_bodies(chat))
        def one(body: dict) -> None:
            response = client.post(path, content=json.dumps(body))  # ensure_ascii: surrogates as \\u escapes
            statuses.append(assert_well_formed(response, body))

        one()
    assert statuses.count(200) >= 15, sorted(statuses)  # the fuzz reached the engine, not only the validation
    after = server.wait_idle()
    assert after['nanovllm:kv_blocks_used{pool="gpu"}'] == 0 and after["nanovllm:num_requests_pending"] == 0
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert post(server, "/v1/completions", GREEDY).json()["choices"][0]["text"] == greedy_text
    assert "Traceback" not in server.log_path.read_text()


def test_second_sigterm_exits_at_once(server):
    body = {"prompt": "Once upon a time", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None  # draining the request in flight
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) in (0, -signal.SIGTERM)
    assert "the engine failed" not in server.log_path.read_text()
