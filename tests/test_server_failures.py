"""Faults inside the engine, as the server sees them: a failed step fails only its requests, a broken engine is
reported on /health and ends the server with status 1. In process (Starlette's TestClient) on a tiny model, plus
one `nanovllm serve` subprocess whose device always fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from starlette.testclient import TestClient

from nanovllm import LLM, SamplingParams
from nanovllm.server.app import OpenAIServer, ServerOptions
from nanovllm.server.engine_loop import MAX_CONSECUTIVE_STEP_FAILURES
from nanovllm.server.metrics import parse_metrics
from nanovllm.serving_bench import free_port
from server_helpers import SMALL_ENGINE

PROMPT = [5, 6, 7, 8]
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def llm(tiny_llama):
    return LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=32, max_model_len=256, device="cpu")


def fail_steps(llm, monkeypatch, which) -> None:
    """Make the forward pass raise on the step numbers (1, 2, ...) for which which(n) is true."""
    run, calls = llm.runner.run, {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if which(calls["n"]):
            raise RuntimeError(f"injected failure in step {calls['n']}")
        return run(*args)

    monkeypatch.setattr(llm.runner, "run", flaky)


def sse_events(response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(llm, monkeypatch):
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    server = OpenAIServer(llm, ServerOptions(served_model_name="tiny"))
    fail_steps(llm, monkeypatch, lambda n: n in (3, 12))  # 6 tokens take 6 steps: the 1st and 3rd request fail
    with TestClient(server.app) as client:
        failed = client.post("/v1/completions", json=BODY)  # steps 1-3: fails in its third step
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["code"] == "request_failed" and "injected failure" in failed.text
        ok = client.post("/v1/completions", json=BODY)  # steps 4-9
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:  # fails in step 12
            events = sse_events(response)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_failed"
        assert client.get("/health").json() == {"status": "ok"}
        again = client.post("/v1/completions", json=BODY).json()
        assert again["usage"]["completion_tokens"] == len(want.token_ids)
        metrics = client.get("/metrics").text
    assert llm.block_manager.num_used_blocks == 0 and not llm.requests
    assert parse_metrics(metrics)["nanovllm:request_errors_total"] == 2


def test_a_broken_engine_is_reported_and_ends_the_server(llm, monkeypatch):
    server = OpenAIServer(llm, ServerOptions(served_model_name="tiny"))
    fatal = []
    server.engine.on_fatal = lambda: fatal.append(True)
    fail_steps(llm, monkeypatch, lambda n: True)
    with TestClient(server.app) as client:
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
            assert client.post("/v1/completions", json=BODY).status_code == 500
        server.engine.core.join(timeout=30)
        assert fatal == [True]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        refused = client.post("/v1/completions", json=BODY)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_error"


def test_serve_exits_with_status_1_when_the_engine_breaks(tiny_llama, tmp_path):
    script = textwrap.dedent("""
        import sys
        from nanovllm.engine.model_runner import ModelRunner

        def broken(self, *args):
            raise RuntimeError("injected: the device is gone")

        ModelRunner.run = broken
        from nanovllm.cli import main
        main(sys.argv[1:])
    """)
    port = free_port()
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-c", script, "serve", str(tiny_llama), "--port", str(port), "--device",
                             "cpu", "--log-level", "warning", "--engine-core", "thread", *SMALL_ENGINE], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if k != "NANOVLLM_API_KEY"})
    try:
        from nanovllm.serving_bench import wait_healthy

        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout=120)
        codes = []
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
            codes.append(httpx.post(f"{url}/v1/completions", json=BODY, timeout=30).status_code)
        assert codes == [500] * len(codes)
        assert proc.wait(timeout=60) == 1, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "error: the engine failed" in log.read_text()
