"""vLLM-style progress and logs: token speeds on the generate() bar, the KV pool at start, request lines."""
from __future__ import annotations

import logging
import re

import pytest

from nanovllm import LLM, SamplingParams, request_log


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=16, max_model_len=256, device="cpu")


def test_generate_bar_shows_input_and_output_token_speeds(llm, capsys):
    params = SamplingParams(temperature=0, n=2, max_tokens=3, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5]], params)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    match = re.search(r"4/4 .*est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", bar)
    assert match, bar
    tokens_in, tokens_out = map(float, match.groups())
    assert tokens_in > 0 and tokens_out > 0 and tokens_in / tokens_out == pytest.approx(10 / 12, rel=0.01)


def test_engine_logs_the_kv_pool_at_start(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="nanovllm")
    LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=16, max_model_len=64, device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    assert len(lines) == 1
    assert re.fullmatch(r"KV cache on cpu: 16 device blocks \(0\.00 GiB\) \+ 0 host blocks \(0\.00 GiB\) of 16 tokens; "
                        r"max concurrent sequences at max_model_len=64: 4\.00 on the device, 4\.00 with the host pool",
                        lines[0]), lines[0]


def test_requests_are_logged_only_when_enabled(llm, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="nanovllm")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not [r for r in caplog.records if r.name == "nanovllm.requests"]
    monkeypatch.setattr(request_log, "_enabled", False)
    request_log.enable()
    rid = llm.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, seed=5), request_id="req-7")
    llm.abort_request(rid)
    lines = [r.getMessage() for r in caplog.records if r.name == "nanovllm.requests"]
    assert len(lines) == 1 and lines[0].startswith("Received request req-7: prompt tokens: 4, params: SamplingParams(")
    assert "seed=5" in lines[0]


def test_serve_has_the_enable_log_requests_flag():
    from nanovllm.cli import build_parser

    assert build_parser().parse_args(["serve", "--enable-log-requests"]).enable_log_requests is True
    assert build_parser().parse_args(["serve"]).enable_log_requests is False
