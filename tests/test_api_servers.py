"""`nanovllm serve --api-server-count N`: N HTTP front-end processes over one engine process
(server/api_servers.py, engine_core.SharedCore). The engine process routes each front end's requests back to it,
aborts those of a front end that goes away, and the server drains on SIGTERM across every process."""
from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from conftest import make_tiny_model
from nanovllm import LLM, SamplingParams
from nanovllm.server.app import ServerOptions, check_api_server_count
from nanovllm.server.engine_core import CoreClient, SharedCore
from nanovllm.serving_bench import front_end_pids, wait_front_ends
from server_helpers import ServerProcess

ENGINE = dict(kvcache_block_size=16, num_gpu_blocks=32, max_model_len=256, device="cpu", dtype="float32")
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "List three colours:",
           "Water boils at", "The quick brown fox", "import numpy as", "My favourite food is"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_model(smollm2_path, tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, so that replies have text."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_tok"), "llama", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, path / name)
    return path


# ---- the engine process over several front ends, without HTTP ---------------------------------

class Recorded:
    """CoreEvents that keep what they hear."""

    def __init__(self):
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def accepted(self, request_id): self.events.put(("accepted", request_id))

    def refused(self, request_id, error): self.events.put(("refused", request_id, error))

    def stepped(self, outputs, first_scheduled, step_started, stats):
        for out in outputs:
            self.events.put(("output", out.request_id, list(out.token_ids), out.finished))

    def failed(self, request_id, error): self.events.put(("failed", request_id, error))

    def released(self, request_id, kind): self.events.put(("released", request_id, kind))

    def fatal(self, error): self.events.put(("fatal", error))

    def final_tokens(self, request_id: str, timeout: float = 60) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            assert event[0] in ("accepted", "output"), event
            if event[0] == "output" and event[1] == request_id and event[3]:
                return event[2]


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_engine_process_routes_each_front_ends_requests_and_aborts_a_gone_ones(tiny_llama):
    core = SharedCore(str(tiny_llama), 2, **ENGINE)
    first, second = CoreClient(core.links[0], core.start), CoreClient(core.links[1], core.start)  # both here
    heard = [Recorded(), Recorded()]
    first.start(heard[0])
    second.start(heard[1])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(tiny_llama), **ENGINE).generate([[5, 6, 7], [9, 10, 11, 12]], params, use_tqdm=False)
    first.post(("add", "same-id", [5, 6, 7], params))  # the same id from both: no collision in the engine
    second.post(("add", "same-id", [9, 10, 11, 12], params))
    assert heard[0].final_tokens("same-id") == want[0].token_ids
    assert heard[1].final_tokens("same-id") == want[1].token_ids
    second.post(("add", "long", [3] * 100, SamplingParams(max_tokens=150, ignore_eos=True)))
    wait_for(lambda: first.stats().gpu_blocks_used > 0)  # the first front end hears every step's gauges
    second._commands_in.close()  # the second front end goes away with its request in flight
    second._events.close()
    wait_for(lambda: first.stats().gpu_blocks_used == 0 and first.stats().num_running == 0)
    first.post(("add", "after", [5, 6, 7], params))  # the first goes on
    assert heard[0].final_tokens("after") == want[0].token_ids
    first.stop(timeout=30)  # the last front end to stop ends the engine process
    core.join(30)
    assert core.process.exitcode == 0



def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


class _FakeCore:
    def __init__(self, process):
        self.process = process

    def join(self, timeout=None):
        self.process.join(timeout)


@pytest.mark.parametrize("signalled, core_code, want", [(True, 0, 0), (True, 1, 1), (False, 0, 1)],
                         ids=["drained", "engine-failed", "unasked"])
def test_the_supervisor_reads_an_engine_process_ending_before_the_last_front_end(signalled, core_code, want):
    """After a signal the engine process ends (0) once the last front end stopped, which may be before that
    front end has exited: that is a drain (exit 0), not a failure; an engine that ends with another status, or
    ends unasked, is one (exit 1)."""
    import multiprocessing

    from nanovllm.server.api_servers import Supervisor

    context = multiprocessing.get_context("fork")
    core = context.Process(target=_exit_after, args=(0.0, core_code))
    front_end = context.Process(target=_exit_after, args=(1.0, 0))
    core.start()
    front_end.start()
    supervisor = Supervisor(_FakeCore(core), [front_end])
    supervisor.signalled = signalled
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    try:
        assert supervisor.run() == want
    finally:
        for sig, handler in zip((signal.SIGINT, signal.SIGTERM), handlers):
            signal.signal(sig, handler)

# ---- the server --------------------------------------------------------------------------

def test_api_server_count_is_validated(tiny_model):
    with pytest.raises(ValueError, match="api_server_count must be an int >= 1"):
        ServerOptions(api_server_count=0)
    with pytest.raises(ValueError, match="needs --engine-core process"):
        check_api_server_count(2, "thread")
    result = subprocess.run([sys.executable, "-m", "nanovllm.cli", "serve", str(tiny_model), "--device", "cpu",
                             "--api-server-count", "2", "--engine-core", "thread"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "needs --engine-core process" in result.stderr, result.stderr[-2000:]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, ["--device", "cpu", "--num-gpu-blocks", "128", "--api-server-count", "3"],
                        tmp_path_factory.mktemp("api3") / "server.log")
    wait_front_ends(srv.proc.pid, 3)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict[str, str]:
    llm = LLM(str(tiny_model), **{**ENGINE, "num_gpu_blocks": 64})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return {prompt: out.text for prompt, out in zip(PROMPTS, outs)}


def stream_completion(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[int, str, object]:
    """(serving front end's pid, text, usage) of one streamed completion, on a connection of its own."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    pid = int(raw.headers["x-nanovllm-frontend"])
    text, usage = "", None
    for chunk in raw.parse():
        text += "".join(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    client.close()
    return pid, text, usage


def test_concurrent_streams_are_spread_over_the_front_ends_and_complete(server, expected):
    front_ends = set(front_end_pids(server.proc.pid))
    assert len(front_ends) == 3
    work = PROMPTS * 3
    with ThreadPoolExecutor(len(work)) as pool:
        results = list(pool.map(lambda prompt: stream_completion(server.url, prompt), work))
    for prompt, (pid, text, usage) in zip(work, results):
        assert pid in front_ends
        assert text == expected[prompt]
        assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens > 0
    assert len({pid for pid, _, _ in results}) > 1
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["smollm2"]


def test_a_client_disconnect_frees_its_kv_blocks_in_the_engine(server):
    body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    before = server.wait_idle()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 3
        assert server.metrics()['nanovllm:kv_blocks_used{pool="gpu"}'] > 0
    after = server.wait_idle()
    assert after['nanovllm:kv_blocks_used{pool="gpu"}'] == 0 and after["nanovllm:num_requests_running"] == 0
    assert before['nanovllm:kv_blocks_used{pool="gpu"}'] == 0


def long_stream_on(server, pid_wanted: int | None = None):
    """An open streaming response (and its first lines) for a long request, served by `pid_wanted` if given."""
    body = {"model": "smollm2", "prompt": PROMPTS[1], "max_tokens": 240, "ignore_eos": True, "stream": True}
    for _ in range(50):
        client = httpx.Client(timeout=60)
        response = client.send(client.build_request("POST", f"{server.url}/v1/completions", json=body), stream=True)
        pid = int(response.headers["x-nanovllm-frontend"])
        if pid_wanted is None or pid == pid_wanted:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            return client, response, lines, pid
        response.close()
        client.close()
    raise AssertionError(f"no response from front end {pid_wanted}")


def test_killing_a_front_end_aborts_its_requests_and_the_others_go_on(server, expected):
    client, response, lines, victim = long_stream_on(server)
    assert server.metrics()["nanovllm:num_requests_running"] >= 1
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(httpx.HTTPError):
        for _ in lines:
            pass
    client.close()
    deadline = time.monotonic() + 60  # the parent reaps the killed process when its wait wakes up
    while victim in front_end_pids(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim not in front_end_pids(server.proc.pid)
    idle = server.wait_idle()
    assert idle['nanovllm:kv_blocks_used{pool="gpu"}'] == 0 and idle["nanovllm:num_requests_running"] == 0
    for _ in range(4):
        pid, text, _ = stream_completion(server.url, PROMPTS[2])
        assert pid != victim and text == expected[PROMPTS[2]]
    assert server.proc.poll() is None
    assert "went away with 1 requests in flight" in server.log_path.read_text()


def test_sigterm_drains_every_front_end_and_exits_0(tiny_model, tmp_path):
    srv = ServerProcess(tiny_model, ["--device", "cpu", "--api-server-count", "2"], tmp_path / "server.log")
    wait_front_ends(srv.proc.pid, 2)
    try:
        finished, streaming = [], threading.Semaphore(0)

        def stream(pid_wanted):
            client, response, lines, _ = long_stream_on(srv, pid_wanted)
            streaming.release()
            finished.append([line for line in lines if line.startswith("data: ")][-1])
            client.close()

        threads = [threading.Thread(target=stream, args=(pid,)) for pid in front_end_pids(srv.proc.pid)]
        for thread in threads:
            thread.start()
        for _ in threads:  # one stream in flight in each front end
            assert streaming.acquire(timeout=120)
        assert srv.metrics()["nanovllm:num_requests_running"] == 2
        srv.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=120)
        assert finished == ["data: [DONE]", "data: [DONE]"]
        assert srv.proc.wait(timeout=60) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    log = srv.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]


def test_the_engine_process_dying_ends_every_front_end_and_the_server_exits_1(tiny_model, tmp_path):
    srv = ServerProcess(tiny_model, ["--device", "cpu", "--api-server-count", "2"], tmp_path / "server.log")
    try:
        children = Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read_text().split()
        core = next(int(pid) for pid in children if Path(f"/proc/{pid}/comm").read_text().strip() == "nanovllm-core")
        os.kill(core, signal.SIGKILL)
        assert srv.proc.wait(timeout=60) == 1
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    log = srv.log_path.read_text()
    assert log.count("error: the engine failed") == 2, log[-3000:]
