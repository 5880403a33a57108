"""The OpenAI-compatible server against the official `openai` client, with SmolLM2 on the CPU."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")  # the test extra installs both; a bare GPU image may not
openai = pytest.importorskip("openai")

from nanovllm import LLM, SamplingParams
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a primary colour."}]]
MAX_TOKENS = 12
MAX_PENDING = 3


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(smollm2_path, ["--num-gpu-blocks", "64", "--max-pending-requests", str(MAX_PENDING)], log)
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), log.read_text()[-3000:]  # uvicorn re-raises the signal after draining


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", kvcache_block_size=16, num_gpu_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(server, path: str, body, raw: bool = False) -> httpx.Response:
    content = body if raw else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=60)


def test_models_and_health(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]


def test_completions_equal_llm_generate(server, client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
    by_ids = client.completions.create(model="smollm2", prompt=expected[0].prompt_token_ids, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert by_ids.choices[0].text == expected[0].text


def test_chat_equals_llm_chat(server, client, llm):
    expected = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for conversation, want in zip(CHATS, expected):
        got = client.chat.completions.create(model="smollm2", messages=conversation, max_tokens=MAX_TOKENS,
                                             temperature=0)
        assert got.choices[0].message.role == "assistant"
        assert got.choices[0].message.content == want.text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert "Paris" in expected[0].text


def test_streaming_completion_matches_non_streaming(client):
    full = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # tokens arrive one by one, not in one piece
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streaming_chat(client):
    full = client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_stop_string_never_streamed(client):
    base = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a stop string from the middle of the greedy text
    assert len(stop) == 3 and stop.strip()
    full = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                     stop=[stop])
    assert full.choices[0].finish_reason == "stop" and full.choices[0].text == text[: text.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True))
    assert streamed == full.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9)
    a, b = (client.completions.create(seed=7, **kwargs).choices[0].text for _ in range(2))
    assert a == b


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("/v1/completions", b'["not", "an", "object"]', 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "not_an_option": 1}, 400, "not_an_option"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_tokens"),
])
def test_invalid_requests_get_4xx_naming_the_field(server, path, body, status, param):
    response = post(server, path, body, raw=isinstance(body, bytes))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_prompt_over_the_limit_names_max_model_len(server, client):
    response = post(server, "/v1/completions", {"prompt": " word" * 300, "max_tokens": 4})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "max_model_len=256" in error["message"] and error["param"] == "prompt"
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": " word" * 300}])
    # still serving
    assert client.completions.create(model="smollm2", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_aborts_and_frees_kv_blocks(server):
    before = server.metrics()
    body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 3
        assert server.metrics()['nanovllm_kv_blocks_used{pool="gpu"}'] > 0
    after = server.wait_idle()
    assert after['nanovllm_kv_blocks_used{pool="gpu"}'] == 0
    aborted = 'nanovllm_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    assert after["nanovllm_generation_tokens_total"] - before["nanovllm_generation_tokens_total"] < 200


def test_non_streaming_disconnect_aborts(server):
    before = server.metrics()
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    after = server.wait_idle()
    aborted = 'nanovllm_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1 and after['nanovllm_kv_blocks_used{pool="gpu"}'] == 0
    assert after["nanovllm_generation_tokens_total"] - before["nanovllm_generation_tokens_total"] < 200
    log = server.log_path.read_text()
    assert "InvalidStateError" not in log and "Traceback" not in log, log[-3000:]


def test_a_huge_prompt_delays_only_itself_and_its_memory_is_returned(server):
    """Tokenizing 3 MB of text takes seconds, in a preprocessing thread: a stream in flight keeps getting tokens,
    and the server's memory afterwards is what it was (glibc's malloc_trim after a large body)."""
    rss_before = server.rss_mib()
    chunk_times: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                chunk_times.append(time.monotonic())
                if done.is_set():
                    break  # hanging up aborts the rest

    reader = threading.Thread(target=stream)
    reader.start()
    while len(chunk_times) < 3:
        time.sleep(0.05)
    started = time.monotonic()
    huge = post(server, "/v1/completions", {"prompt": "hello world, this is a test. " * 100_000, "max_tokens": 1})
    took = time.monotonic() - started
    done.set()
    reader.join(timeout=120)
    assert huge.status_code == 400 and "max_model_len=256" in huge.json()["error"]["message"]
    during = [t for t in chunk_times if started <= t <= started + took]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) >= 3 and max(gaps) < 0.5 * took, (took, gaps)
    server.wait_idle()
    assert server.rss_mib() - rss_before < 100, (rss_before, server.rss_mib())


def test_overload_gets_503_with_an_error_body(server):
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(3 * MAX_PENDING)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= MAX_PENDING and codes.count(503) >= 1 and set(codes) <= {200, 503}, codes
    refused = next(r for r in responses if r.status_code == 503)
    assert "max_pending_requests=3" in refused.json()["error"]["message"] and refused.headers["Retry-After"]
    assert server.metrics()['nanovllm_requests_rejected_total{reason="overloaded"}'] >= 1
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_metrics_are_prometheus_text(server):
    text = httpx.get(f"{server.url}/metrics").text
    m = server.wait_idle()
    for name in ("nanovllm_time_to_first_token_seconds", "nanovllm_inter_token_latency_seconds",
                 "nanovllm_e2e_request_latency_seconds"):
        assert f"# TYPE {name} histogram" in text
        assert m[f"{name}_count"] > 0 and m[f'{name}_bucket{{le="+Inf"}}'] == m[f"{name}_count"]
    assert m["nanovllm_prompt_tokens_total"] > 0 and m["nanovllm_generation_tokens_total"] > 0
    assert m['nanovllm_kv_blocks_total{pool="gpu"}'] == 64 and m['nanovllm_kv_blocks_used{pool="host"}'] == 0
    assert m['nanovllm_requests_finished_total{finish_reason="length"}'] > 0
    assert m["nanovllm_requests_pending"] == 0 and m["nanovllm_requests_running"] == 0
