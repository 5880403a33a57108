"""Streaming from a model without a tokenizer (random-weight benchmark configs): a chunk per step with new
tokens, as vLLM sends, even though their text is empty. In process (Starlette's TestClient), tiny model."""
from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")

from starlette.testclient import TestClient

from nanovllm import LLM
from nanovllm.server.app import OpenAIServer, ServerOptions

TOKENS = 6


def test_a_model_without_tokenizer_streams_a_chunk_per_step(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=32, max_model_len=256, device="cpu")
    assert llm.tokenizer is None
    run = llm.runner.run
    monkeypatch.setattr(llm.runner, "run", lambda *a: time.sleep(0.02) or run(*a))  # steps the client keeps up with
    server = OpenAIServer(llm, ServerOptions(served_model_name="tiny"))
    body = {"prompt": [5, 6, 7, 8], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with TestClient(server.app) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [e for e in events if e["choices"]]
    assert 2 <= len(chunks) <= TOKENS  # one per step (consecutive ones merge only when the client falls behind)
    assert all(c["choices"][0]["text"] == "" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert events[-1]["usage"]["completion_tokens"] == TOKENS
