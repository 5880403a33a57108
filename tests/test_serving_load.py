"""The server under load from a separate process: 100 concurrent streams, ~20% hang up early.

Every request that stays connected must complete with exactly the greedy text of the same request
sent alone without streaming; afterwards no
KV block is in use, nothing runs, and the server is healthy. Last, SIGTERM drains a request in flight.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "The three primary colours are",
           "import numpy as np\n", "Water boils at", "My favourite fruit is", "The sun rises in the"]
MAX_TOKENS = 8
REQUESTS = 100


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("load") / "server.log"
    srv = ServerProcess(smollm2_path, ["--num-gpu-blocks", "256", "--max-pending-requests", "128"], log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(server) -> dict[str, str]:
    """One non-streaming greedy request per prompt, alone on the server (test_server checks these equal
    LLM.generate; here that would cost a second model load)."""
    texts = {}
    for prompt in PROMPTS:
        response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        texts[prompt] = response.json()["choices"][0]["text"]
    return texts


def test_100_concurrent_streams_with_disconnects(server, expected):
    before = server.metrics()
    client = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "load_client.py"), server.url, json.dumps(PROMPTS),
         "--requests", str(REQUESTS), "--disconnect-fraction", "0.2", "--max-tokens", str(MAX_TOKENS)],
        capture_output=True, text=True, timeout=300)
    assert client.returncode == 0, client.stderr[-3000:]
    results = json.loads(client.stdout)
    kept = [r for r in results if not r["aborted"]]
    hung_up = [r for r in results if r["aborted"]]
    assert len(results) == REQUESTS and 10 <= len(hung_up) <= 30
    assert all(r["status"] == 200 for r in results)
    for r in kept:
        prompt = PROMPTS[r["index"] % len(PROMPTS)]
        assert r["done"] and r["finish_reason"] in ("stop", "length"), r
        assert r["text"] == expected[prompt], (prompt, r["text"], expected[prompt])

    def ended(m: dict[str, float], reasons: tuple[str, ...] = ("stop", "length", "abort")) -> float:
        return sum(m[f'nanovllm:request_success_total{{finished_reason="{r}"}}']
                   - before[f'nanovllm:request_success_total{{finished_reason="{r}"}}'] for r in reasons)

    after = server.wait_idle(until=lambda m: ended(m) >= REQUESTS)  # ends are counted after the engine is idle
    assert after['nanovllm:kv_blocks_used{pool="gpu"}'] == 0  # no leaked blocks
    assert after["nanovllm:num_requests_running"] == 0 and after["nanovllm:num_requests_waiting"] == 0
    finished, aborted = ended(after, ("stop", "length")), ended(after, ("abort",))
    assert finished + aborted == REQUESTS and finished >= len(kept)  # a hang-up after the last token is no abort
    assert httpx.get(f"{server.url}/health").status_code == 200
    again = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert again.json()["choices"][0]["text"] == expected[PROMPTS[0]]


def test_bench_client_in_several_processes_counts_every_token(server):
    """bench serving's client split over 2 processes: every request and token counted once, one duration
    over both, and the CPU busy fractions of the client and of the server's process measured."""
    from nanovllm.serving_bench import make_workload, run_rate

    prompts, out_lens = make_workload(12, 8, 6, vocab_size=1000, seed=3)
    result = run_rate(server.url, "smollm2", prompts, out_lens, math.inf, processes=2, server_pid=server.proc.pid)
    assert result["completed"] == 12 and result["failed"] == 0 and result["output_tokens"] == 12 * 6
    assert result["client_processes"] == 2 and 0 < result["client_cpu_busy"] < 2
    assert 0 < result["server_cpu_busy"] and result["duration_s"] > 0
    steps = result["engine_steps"]  # from the server's /metrics around the run: at least one step per output token
    assert set(steps) == {"decode", "mixed", "prefill"} and sum(steps.values()) >= 6, steps
    assert 0 < result["engine_step_s"] < result["duration_s"]  # the engine's time in steps over the run
    assert 0 <= result["engine_gc_s"] < result["duration_s"]  # its process's garbage collections
    forward = result["engine_forward_s"]  # host time in the steps' forward passes, by kind: each within the steps'
    assert set(forward) == set(steps) and 0 < sum(forward.values()) < result["engine_step_s"], forward
    assert all((seconds > 0) == (steps[kind] > 0) for kind, seconds in forward.items()), (forward, steps)
    # polled from /metrics while the run went on: a step is counted when it ends, so a tenth shorter than a CPU
    # step can hold more than its length; over the run they add up to the engine's step seconds
    busy = result["engine_busy_by_tenth"]
    assert len(busy) == 10 and min(busy) >= 0, busy
    assert abs(sum(busy) / 10 - result["engine_step_s"] / result["duration_s"]) < 0.2, busy


@pytest.mark.parametrize("library", ["aiohttp", "httpx"])
def test_bench_duration_runs_from_the_first_send_to_the_last_response(server, monkeypatch, library):
    """The client's own set-up (a slow connection pool here) is not the server's time: the run's duration is
    no longer than the slowest request's end-to-end time plus a little. Each request's times come from its own
    stream: a first token, then one gap per further token."""
    import aiohttp

    from nanovllm.serving_bench import make_workload, run_rate

    module, name = (httpx, "AsyncClient") if library == "httpx" else (aiohttp, "ClientSession")
    fast = getattr(module, name)

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return fast(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)
    prompts, out_lens = make_workload(4, 8, 4, vocab_size=1000, seed=5)
    result = run_rate(server.url, "smollm2", prompts, out_lens, math.inf, library=library)
    assert result["completed"] == 4 and result["output_tokens"] == 16 and result["http_client"] == library
    assert result["duration_s"] < result["e2e_s"]["p99"] + 0.2, result
    assert 0 < result["ttft_s"]["p50"] <= result["e2e_s"]["p50"] and result["itl_s"]["p50"] > 0


def test_sigterm_drains_requests_in_flight(server):
    body = {"prompt": PROMPTS[2], "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks: list[dict] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert chunks, "no chunk arrived"
    server.proc.send_signal(signal.SIGTERM)
    reader.join(timeout=120)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 64 tokens arrived after the signal
    assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
