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
    tmp = tmp_path_factory.mktemp("server")
    template = tmp / "template.jinja"  # the model's own template, from a file: chat replies still equal LLM.chat's
    template.write_text((smollm2_path / "chat_template.jinja").read_text())
    args = ["--num-gpu-blocks", "64", "--max-pending-requests", str(MAX_PENDING), "--chat-template", str(template)]
    srv = ServerProcess(smollm2_path, args, tmp / "server.log", model_option=True)
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.log_path.read_text()[-3000:]  # uvicorn re-raises SIGTERM


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
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": ["hi", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}, 400,
     "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs"),
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
        assert server.metrics()['nanovllm:kv_blocks_used{pool="gpu"}'] > 0
    aborted = 'nanovllm:request_success_total{finished_reason="abort"}'
    after = server.wait_idle(until=lambda m: m[aborted] > before[aborted])
    assert after['nanovllm:kv_blocks_used{pool="gpu"}'] == 0
    assert after[aborted] == before[aborted] + 1
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 200


def test_non_streaming_disconnect_aborts(server):
    before = server.metrics()
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    aborted = 'nanovllm:request_success_total{finished_reason="abort"}'
    after = server.wait_idle(until=lambda m: m[aborted] > before[aborted])
    assert after[aborted] == before[aborted] + 1 and after['nanovllm:kv_blocks_used{pool="gpu"}'] == 0
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 200
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
    assert server.metrics()['nanovllm:requests_rejected_total{reason="overloaded"}'] >= 1
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_metrics_are_prometheus_text(server):
    """vLLM's metric names under nanovllm:, parsed by prometheus_client's own parser, every sample labelled
    with the model name."""
    from prometheus_client.parser import text_string_to_metric_families

    from nanovllm.server.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

    for _ in range(2):  # the chat template's system prompt fills a KV block: the second one hits the prefix cache
        assert post(server, "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 2}).status_code == 200
    # one that ends in its first step still has its queue time recorded
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    m = server.wait_idle()
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    kinds = {name: f.type for name, f in families.items()}
    assert kinds == {
        "nanovllm:num_requests_running": "gauge", "nanovllm:num_requests_waiting": "gauge",
        "nanovllm:num_requests_pending": "gauge", "nanovllm:kv_cache_usage_perc": "gauge",
        "nanovllm:prefix_cache_queries": "counter", "nanovllm:prefix_cache_hits": "counter",
        "nanovllm:num_preemptions": "counter", "nanovllm:prompt_tokens": "counter",
        "nanovllm:generation_tokens": "counter", "nanovllm:request_success": "counter",
        "nanovllm:request_errors": "counter", "nanovllm:requests_rejected": "counter",
        "nanovllm:kv_blocks_used": "gauge", "nanovllm:kv_blocks_total": "gauge",
        "nanovllm:host_kv_bytes_read": "counter", "nanovllm:engine_steps": "counter",
        "nanovllm:engine_step_seconds": "counter", "nanovllm:engine_gc_seconds": "counter",
        "nanovllm:engine_forward_seconds": "counter",
        "nanovllm:time_to_first_token_seconds": "histogram",
        "nanovllm:inter_token_latency_seconds": "histogram", "nanovllm:e2e_request_latency_seconds": "histogram",
        "nanovllm:request_queue_time_seconds": "histogram"}
    assert all(s.labels["model_name"] == "smollm2" for f in families.values() for s in f.samples)
    for name, buckets in (("nanovllm:time_to_first_token_seconds", TTFT_BUCKETS),
                          ("nanovllm:inter_token_latency_seconds", ITL_BUCKETS),
                          ("nanovllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
                          ("nanovllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)):
        bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert bounds == [*buckets, float("inf")]
        assert m[f"{name}_count"] > 0 and m[f'{name}_bucket{{le="+Inf"}}'] == m[f"{name}_count"]
    assert m["nanovllm:prompt_tokens_total"] > 0 and m["nanovllm:generation_tokens_total"] > 0
    assert m["nanovllm:prefix_cache_queries_total"] >= m["nanovllm:prompt_tokens_total"] > 0
    assert 0 < m["nanovllm:prefix_cache_hits_total"] < m["nanovllm:prefix_cache_queries_total"]  # repeated prompts
    assert m['nanovllm:kv_blocks_total{pool="gpu"}'] == 64 and m['nanovllm:kv_blocks_used{pool="host"}'] == 0
    assert m["nanovllm:kv_cache_usage_perc"] == 0 and m["nanovllm:host_kv_bytes_read_total"] == 0
    assert m['nanovllm:request_success_total{finished_reason="length"}'] > 0
    assert m["nanovllm:request_queue_time_seconds_count"] == m["nanovllm:time_to_first_token_seconds_count"]
    assert m["nanovllm:num_requests_pending"] == 0 and m["nanovllm:num_requests_running"] == 0
    steps = {kind: m[f'nanovllm:engine_steps_total{{kind="{kind}"}}'] for kind in ("decode", "mixed", "prefill")}
    # the chats' prompts prefilled and their second tokens decoded ("Hi" is one token: its one step a decode step)
    assert steps["prefill"] >= 2 and steps["decode"] >= 3, steps
    assert m["nanovllm:engine_step_seconds_total"] > 0
    forward = {kind: m[f'nanovllm:engine_forward_seconds_total{{kind="{kind}"}}'] for kind in steps}
    assert forward["prefill"] > 0 and forward["decode"] > 0
    assert sum(forward.values()) < m["nanovllm:engine_step_seconds_total"]


def test_unknown_fields_are_ignored_with_a_warning(server, client):
    want = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0].text
    response = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                                 "not_an_option": 1, "metadata": {"a": 1}})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == want
    assert "/v1/completions: ignored unknown fields 'not_an_option', 'metadata'" in server.log_path.read_text()


def test_a_list_of_prompts_and_n(server, client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    batch = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [e.text for e in expected]
    by_ids = client.completions.create(model="smollm2", prompt=[e.prompt_token_ids for e in expected[1:]],
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in by_ids.choices] == [e.text for e in expected[1:]]
    assert batch.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert batch.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    kwargs = dict(model="smollm2", max_tokens=6, temperature=1.0, seed=11)
    sampled = client.completions.create(prompt=PROMPTS[0], n=3, **kwargs)
    for j in range(3):  # sample j is seeded with seed + j, as vLLM seeds its n children
        alone = client.completions.create(prompt=PROMPTS[0], **{**kwargs, "seed": 11 + j}).choices[0].text
        assert sampled.choices[j].index == j and sampled.choices[j].text == alone
    assert len({c.text for c in sampled.choices}) > 1
    chat = client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    too_many = post(server, "/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 1})
    assert too_many.status_code == 400 and "max_pending_requests=3" in too_many.json()["error"]["message"]


def test_choice_index_is_prompt_times_n_plus_sample(llm):
    """Two prompts x n=2 (more than the subprocess server's max_pending_requests=3): in process."""
    from starlette.testclient import TestClient

    from nanovllm.server.app import OpenAIServer, ServerOptions

    body = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    with TestClient(OpenAIServer(llm, ServerOptions(served_model_name="smollm2")).app) as http:
        choices = http.post("/v1/completions", json=body).json()["choices"]
        for i, prompt in enumerate(PROMPTS[:2]):
            for j in range(2):
                alone = http.post("/v1/completions", json={**body, "prompt": prompt, "n": 1, "seed": 11 + j}).json()
                assert choices[i * 2 + j]["index"] == i * 2 + j
                assert choices[i * 2 + j]["text"] == alone["choices"][0]["text"]


def test_completion_logprobs_and_echo_match_llm_generate(client, llm):
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2),
                        use_tqdm=False)[0]
    tok = llm.tokenizer
    got = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2,
                                    echo=True).choices[0]
    assert got.text == PROMPTS[0] + want.text
    ids = want.prompt_token_ids + want.token_ids
    entries = want.prompt_logprobs + want.outputs[0].logprobs
    lp = got.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e[t] for t, e in zip(ids[1:], entries[1:])], abs=1e-5)
    for top, entry in zip(lp.top_logprobs[1:], entries[1:]):
        assert top == pytest.approx({tok.decode([t]): v for t, v in entry.items()}, abs=1e-5) and len(top) in (2, 3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    plain = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[len(want.prompt_token_ids):],
                                                                     abs=1e-5)
    assert all(len(top) == 1 for top in plain.choices[0].logprobs.top_logprobs)
    streamed = list(client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                              logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == got.text
    assert sum((c.choices[0].logprobs.tokens for c in streamed if c.choices[0].logprobs), []) == lp.tokens
    assert sum((c.choices[0].logprobs.text_offset for c in streamed if c.choices[0].logprobs), []) == lp.text_offset


def test_chat_logprobs_match_llm_chat(client, llm):
    want = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    got = client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3).choices[0]
    content = got.logprobs.content
    assert [c.token for c in content] == [llm.tokenizer.decode([t]) for t in want.token_ids]
    for c, t, entry in zip(content, want.token_ids, want.outputs[0].logprobs):
        assert c.logprob == pytest.approx(entry[t], abs=1e-5) and c.bytes == list(c.token.encode())
        top = sorted(entry.values(), reverse=True)[:3]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(top, abs=1e-5)
    no_top = client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=5, temperature=0,
                                            logprobs=True).choices[0].logprobs.content
    assert [c.top_logprobs for c in no_top] == [[]] * 5
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = sum((c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs), [])
    assert [c.token for c in streamed] == [c.token for c in content]


def test_chat_template_options(server, client, llm):
    tok = llm.tokenizer
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour"}]

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model="smollm2", messages=conversation, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    def template(**kwargs) -> int:
        return len(tok.apply_chat_template(conversation, tokenize=True, **kwargs)["input_ids"])

    assert prompt_tokens() == template(add_generation_prompt=True)
    assert prompt_tokens(add_generation_prompt=False) == template(add_generation_prompt=False)
    assert prompt_tokens(add_generation_prompt=False, continue_final_message=True) == \
        template(continue_final_message=True)
    continued = client.chat.completions.create(model="smollm2", messages=conversation, max_tokens=4, temperature=0,
                                               extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True})
    ids = tok.apply_chat_template(conversation, tokenize=True, continue_final_message=True)["input_ids"]
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert continued.choices[0].message.content == want.text
    follow_up = [*CHATS[0], {"role": "assistant", "content": None}, {"role": "user", "content": "And of Italy?"}]
    null = client.chat.completions.create(model="smollm2", max_tokens=2, messages=follow_up)
    as_empty = [*CHATS[0], {"role": "assistant", "content": ""}, follow_up[-1]]
    assert null.usage.prompt_tokens == len(tok.apply_chat_template(as_empty, tokenize=True,
                                                                   add_generation_prompt=True)["input_ids"])
    with_kwargs = post(server, "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 1,
                                                        "chat_template_kwargs": {"unused_flag": True}})
    assert with_kwargs.status_code == 200


def test_chat_template_from_the_command_line_and_kwargs(llm):
    """--chat-template (here as a string, in process) replaces the model's template; chat_template_kwargs reach it."""
    from starlette.testclient import TestClient

    from nanovllm.server.app import OpenAIServer, ServerOptions, load_chat_template

    template = load_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                                  "{% if shout %}!{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")
    server = OpenAIServer(llm, ServerOptions(served_model_name="smollm2", chat_template=template))
    messages = [{"role": "user", "content": "Hi"}]
    with TestClient(server.app) as http:
        plain = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        shout = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"shout": True},
                                             "add_generation_prompt": False}).json()["tokens"]
        reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
    assert plain == llm.tokenizer("<user>Hi<assistant>", add_special_tokens=False).input_ids
    assert shout == llm.tokenizer("<user>Hi!", add_special_tokens=False).input_ids
    assert reply.json()["usage"]["prompt_tokens"] == len(plain)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_chat_template("/no/such/template.jinja")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for %}")


def test_tokenize_detokenize_version_and_model_card(server, llm):
    ids = llm.tokenizer(PROMPTS[0]).input_ids
    got = post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()
    assert got == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    chat = post(server, "/tokenize", {"model": "smollm2", "messages": CHATS[0]}).json()
    assert chat["tokens"] == llm.tokenizer.apply_chat_template(CHATS[0], tokenize=True,
                                                               add_generation_prompt=True)["input_ids"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPTS[0]}
    for path, body, param in [("/detokenize", {"tokens": [49152]}, "tokens"),
                              ("/detokenize", {"tokens": "a"}, "tokens"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 1}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model")]:
        response = post(server, path, body)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text
    assert httpx.get(f"{server.url}/version").json()["version"]
    card = httpx.get(f"{server.url}/v1/models/smollm2").json()
    assert card["id"] == "smollm2" and card["max_model_len"] == 256
    missing = httpx.get(f"{server.url}/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_penalties_bias_and_min_tokens_over_http_equal_llm_generate(client, llm):
    """The engine's sampling fields reach SamplingParams from the OpenAI client (extra_body for vLLM's own):
    the text equals LLM.generate with the same parameters, and differs from the plain greedy text."""
    prompt, plain = PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    cases = [
        (dict(frequency_penalty=1.5, presence_penalty=1.0), dict(frequency_penalty=1.5, presence_penalty=1.0)),
        (dict(logit_bias={str(forced): 100}), dict(logit_bias={forced: 100.0})),
        (dict(extra_body={"repetition_penalty": 1.8, "min_tokens": 4}), dict(repetition_penalty=1.8, min_tokens=4)),
    ]
    plain_text = llm.generate([prompt], plain, use_tqdm=False)[0].text
    for request, params in cases:
        want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **params), use_tqdm=False)[0]
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **request)
        assert got.choices[0].text == want.text != plain_text


def test_min_tokens_without_max_tokens_and_over_the_limit(server, client):
    """min_tokens with max_tokens left out takes the default limit (16 for a completion); above the limit the
    request gets 400 naming min_tokens."""
    got = client.completions.create(model="smollm2", prompt=PROMPTS[0], temperature=0, extra_body={"min_tokens": 5})
    assert got.usage.completion_tokens >= 5
    response = post(server, "/v1/completions", {"model": "smollm2", "prompt": PROMPTS[0], "min_tokens": 17})
    assert response.status_code == 400 and response.json()["error"]["param"] == "min_tokens"
