"""The server's engine in a process of its own (server/engine_core.EngineProcess, `nanovllm serve`'s default):
the same outputs as in a thread, limits checked on the server's side, bad options raised where the server
starts, a dead engine process reported like a broken engine (the streams in flight get an error event, `serve`
exits 1), and the process gone after shutdown."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from starlette.testclient import TestClient

from nanovllm import LLM, SamplingParams
from nanovllm.server.app import OpenAIServer, ServerOptions
from nanovllm.server.engine_core import EngineProcess
from nanovllm.server.metrics import parse_metrics
from server_helpers import ServerProcess

ENGINE = dict(kvcache_block_size=16, num_gpu_blocks=12, max_model_len=256, device="cpu", dtype="float32")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def engine_process(tiny_llama):
    engine = EngineProcess(str(tiny_llama), **ENGINE)
    yield engine
    engine.stop(timeout=30)


def test_outputs_equal_the_engine_in_this_process(tiny_llama, engine_process):
    assert_outputs_equal_the_engine_in_this_process(tiny_llama, engine_process, ENGINE)


@pytest.mark.cuda
def test_outputs_on_cuda_equal_the_engine_in_this_process(tiny_llama):
    options = {**ENGINE, "device": "cuda"}
    engine = EngineProcess(str(tiny_llama), **options)
    try:
        assert engine.torch_threads == 1  # intra_op_threads: no pool of CPU threads beside the front ends
        assert_outputs_equal_the_engine_in_this_process(tiny_llama, engine, options)
    finally:
        engine.stop(timeout=60)


def assert_outputs_equal_the_engine_in_this_process(tiny_llama, engine: EngineProcess, options: dict) -> None:
    """Greedy logprobs through the server (plain and streamed) equal LLM.generate's in this process."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm = LLM(str(tiny_llama), **options)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    del llm
    server = OpenAIServer(engine, ServerOptions(served_model_name="tiny"))
    with TestClient(server.app) as client:
        for prompt, expected in zip(PROMPTS, want):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            got = choice["logprobs"]["token_logprobs"]
            assert len(got) == len(expected.token_ids) == 12
            wanted = [lp[t] for lp, t in zip(expected.outputs[0].logprobs, expected.token_ids)]
            assert got == pytest.approx(wanted, abs=1e-5)
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            assert sum(len(c["logprobs"]["token_logprobs"]) for c in chunks) == 12
            assert chunks[-1]["finish_reason"] == "length" and events[-1] == "[DONE]"
        metrics = parse_metrics(client.get("/metrics").text)
    assert metrics["nanovllm:generation_tokens_total"] == 2 * 12 * len(PROMPTS)
    assert metrics['nanovllm:kv_blocks_used{pool="gpu"}'] == 0
    assert "nanovllm:engine_gc_seconds_total" in metrics


def test_the_engine_process_freezes_its_start_up_heap(engine_process):
    """A full collection in a built engine's process walks ~450K objects (~0.5 s on the CPU VM): the engine process
    keeps them out of the collector's reach once started."""
    assert engine_process.frozen_objects > 50_000


def test_the_engine_process_keeps_torch_threads_for_a_cpu_model_and_one_for_a_gpu_model(engine_process):
    """A CPU model computes in the engine process with torch's threads; on a GPU one thread does the host's small ops,
    and a pool of them would wait on each other beside the busy front ends (intra_op_threads), unless the user set
    OMP_NUM_THREADS."""
    from nanovllm.server.engine_core import intra_op_threads

    assert engine_process.torch_threads == torch.get_num_threads()
    assert intra_op_threads("cuda", {}) == 1
    assert intra_op_threads("cuda", {"OMP_NUM_THREADS": "4"}) is None and intra_op_threads("cpu", {}) is None


def test_limits_are_checked_on_the_server_side(engine_process):
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine_process.check_request([1] * 300, SamplingParams())
    with pytest.raises(ValueError, match=r"KV blocks .* whole pool has 12 blocks"):
        engine_process.check_request([1] * 100, SamplingParams(max_tokens=1000))
    assert engine_process.config.max_model_len == 256 and engine_process.tokenize([3, 4]) == [3, 4]


def test_bad_options_raise_where_the_server_starts(tiny_llama):
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineProcess(str(tiny_llama), **{**ENGINE, "max_num_seqs": 0})
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seq'"):
        EngineProcess(str(tiny_llama), **ENGINE, max_num_seq=4)


def test_a_dead_engine_process_is_reported_like_a_broken_engine(tiny_llama):
    engine = EngineProcess(str(tiny_llama), **ENGINE)
    server = OpenAIServer(engine, ServerOptions(served_model_name="tiny"))
    fatal = []
    server.engine.on_fatal = lambda: fatal.append(True)
    body = {"prompt": PROMPTS[0], "max_tokens": 2}
    with TestClient(server.app) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        os.kill(engine.pid, signal.SIGKILL)
        engine.join(timeout=30)
        assert fatal == [True]
        health = client.get("/health")
        assert health.status_code == 503 and "engine process exited" in health.json()["error"]
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_error"


def test_serve_fails_the_streams_in_flight_and_exits_1_when_the_engine_process_dies(tiny_llama, tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess(tiny_llama, ["--device", "cpu", "--num-gpu-blocks", "64"], log)
    try:
        children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        engines = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1  # beside multiprocessing's resource tracker
        body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert sum(1 for _, line in zip(range(4), lines) if line.startswith("data: ")) >= 2
            os.kill(int(engines[0]), signal.SIGKILL)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_error", rest[-3:]
        assert server.proc.wait(timeout=60) == 1
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "error: the engine failed" in log.read_text() and "engine process exited" in log.read_text()


def test_shutdown_ends_the_engine_process(tiny_llama):
    engine = EngineProcess(str(tiny_llama), **ENGINE)
    server = OpenAIServer(engine, ServerOptions(served_model_name="tiny"))
    with TestClient(server.app) as client:
        assert client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 3}).status_code == 200
    deadline = time.monotonic() + 30
    while engine._process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine._process.exitcode == 0


def test_offload_host_bytes_reach_the_metrics(tiny_llama):
    """The host KV bytes are sent only when they grow: the counter still sums to the engine's own count."""
    options = {**ENGINE, "num_gpu_blocks": 6, "enable_cpu_offload": True, "cpu_kv_cache_gb": 0.01}
    prompt = [(7 * i) % 200 + 3 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = LLM(str(tiny_llama), **options).generate([prompt], params, use_tqdm=False)[0]
    assert want.metrics.host_kv_bytes_read > 0
    engine = EngineProcess(str(tiny_llama), **options)
    server = OpenAIServer(engine, ServerOptions(served_model_name="tiny"))
    with TestClient(server.app) as client:
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert [line for line in response.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
        metrics = parse_metrics(client.get("/metrics").text)
    assert metrics["nanovllm:host_kv_bytes_read_total"] == want.metrics.host_kv_bytes_read


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_drains_and_exits_0_without_a_traceback(tiny_llama, tmp_path, sig):
    log = tmp_path / "server.log"
    server = ServerProcess(tiny_llama, ["--device", "cpu"], log)
    try:
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3},
                          timeout=60).status_code == 200
        server.proc.send_signal(sig)
        assert server.proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "Traceback" not in log.read_text()


def test_a_server_that_cannot_bind_exits_1_and_ends_its_engine_process(tiny_llama, tmp_path):
    first = ServerProcess(tiny_llama, ["--device", "cpu"], tmp_path / "first.log")
    try:
        second = subprocess.run([sys.executable, "-m", "nanovllm.cli", "serve", str(tiny_llama), "--device", "cpu",
                                  "--port", str(first.port), "--log-level", "warning"],
                                 capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "address already in use" in second.stderr, second.stderr[-2000:]
    finally:
        first.stop()


@pytest.mark.parametrize("build_outputs", [True, False])
def test_the_engine_loop_reports_each_request_first_scheduled_once_at_its_admission(tiny_llama, build_outputs):
    """With more requests than running slots, each request is reported first-scheduled exactly once, in the step
    that first computed any of its tokens (read from the step's admissions, not a scan of every queued request)."""
    from nanovllm.server.engine_loop import EngineLoop

    llm = LLM(str(tiny_llama), device="cpu", kvcache_block_size=16, num_gpu_blocks=64, max_num_seqs=2)
    reported: list[tuple[int, list[str]]] = []

    class Events:
        def __getattr__(self, name):
            return lambda *args: None

        def stepped(self, outputs, first_scheduled, started, stats):
            reported.append((len(reported), list(first_scheduled)))

    loop = EngineLoop(llm, Events(), build_outputs=build_outputs)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i in range(5):
        loop.post(("add", f"r{i}", [3 + i, 4, 5, 6] * 3, params))
    loop.post(("abort", "r4"))  # still queued: never reported
    computed_at: dict[str, int] = {}
    original_step = loop._step

    def step():
        outputs = original_step()
        for rid, req in list(llm.requests.items()):
            if req.seq.num_computed_tokens > 0:
                computed_at.setdefault(rid, len(reported))
        for out in outputs:
            computed_at.setdefault(out.request_id, len(reported))
        return outputs

    loop._step = step
    loop.stop()
    loop.run()
    firsts = [(step_index, rid) for step_index, ids in reported for rid in ids]
    assert sorted(rid for _, rid in firsts) == ["r0", "r1", "r2", "r3"]
    assert {rid: step_index for step_index, rid in firsts} == computed_at


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_through_the_pipe_equal_the_loop_in_this_process(tiny_llama, async_scheduling):
    """Every step's outputs, rebuilt by a front end from the engine process's messages (one new token as the two
    flat lists, the rest as deltas: first outputs, logprobs, finished ones), equal the outputs the same loop builds
    in one process, step by step; an aborted request stops being reported in both. (The server sends n > 1 as n
    requests.)"""
    from multiprocessing import Pipe

    from nanovllm.server.engine_core import CoreClient, CoreStart, PoolLimits, _FrontEnds
    from nanovllm.server.engine_loop import EngineLoop

    class Steps:
        def __init__(self):
            self.steps: list[dict] = []

        def __getattr__(self, name):
            return lambda *args: None

        def stepped(self, outputs, first_scheduled, started, stats):
            self.steps.append({o.request_id: ([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs],
                                              o.finished, [c.finish_reason for c in o.outputs]) for o in outputs})

    requests = [("plain", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
                ("logprobs", [9, 10, 11], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)),
                ("short", [12, 13], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
                ("seeded", [14, 15, 16], SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)),
                ("aborted", [17, 18, 19], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]
    options = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_gpu_blocks=64,
                   async_scheduling=async_scheduling)

    def run(through_pipe: bool) -> list[dict]:
        llm = LLM(str(tiny_llama), **options)
        steps = Steps()
        if through_pipe:
            received, sent = Pipe(duplex=False)
            front_ends = _FrontEnds([sent])
            bm = llm.block_manager
            client = CoreClient((None, received), CoreStart(llm.config, PoolLimits(bm.num_blocks, bm.num_host_blocks,
                                                                                    bm.block_size), llm.stats(), 0, 1))
            loop = EngineLoop(llm, front_ends, build_outputs=False)
        else:
            loop = EngineLoop(llm, steps)
        def post(command: tuple) -> None:
            if through_pipe:
                client._prompts.setdefault(command[1], command[2] if command[0] == "add" else None)
            loop.post(front_ends.command(front_ends.sinks[0], command) if through_pipe else command)

        for request_id, prompt, params in requests:
            post(("add", request_id, prompt, params))
        for step in range(40):
            if step == 3:
                post(("abort", "aborted"))
            if step > 3 and not llm.has_unfinished_requests():
                break
            loop._next_commands()
            started = 0.0
            outputs = loop._step()
            loop.events.stepped(outputs, loop._first_scheduled(), started, llm.stats())
            if through_pipe:
                front_ends.sinks[0].flush(wait=True)  # written by the sink's own thread
            while through_pipe and received.poll():
                for event in received.recv():
                    client._dispatch(steps, event)
        assert not llm.has_unfinished_requests()
        return steps.steps

    in_process, piped = run(False), run(True)
    assert piped == in_process
    assert any(len(step) > 1 for step in piped) and not any("aborted" in step for step in piped[4:])
    assert {rid for step in piped for rid, out in step.items() if out[2]} == {"plain", "logprobs", "short", "seeded"}


def test_events_to_a_front_end_slow_to_read_never_stall_the_engine_loop():
    """The engine loop hands each iteration's events to the front end's writer thread and goes on: with nobody
    reading (a front end busy streaming), 20 messages each larger than a pipe's buffer leave at once (writing in
    the loop's thread blocked on the first); read later, they arrive whole and in order, coalesced as they piled
    up, and close() writes its last words after them."""
    import threading
    from multiprocessing import Pipe

    from nanovllm.server.engine_core import _PipeEvents

    reader, writer = Pipe(duplex=False)
    sink = _PipeEvents(writer, skip=2)
    payload = "x" * 100_000

    def loop() -> None:
        for k in range(20):
            sink.released(f"0:r{k}", payload)
            sink.flush()

    engine_loop = threading.Thread(target=loop, daemon=True)
    engine_loop.start()
    engine_loop.join(timeout=5)
    assert not engine_loop.is_alive(), "the engine loop blocked on a front end that does not read"
    got = []
    while len(got) < 20:
        got += reader.recv()
    assert got == [("released", f"r{k}", payload) for k in range(20)]
    sink.close([("stopped",)])
    assert reader.recv() == [("stopped",)]
    sink.released("0:late", "finish")
    sink.flush()  # after close: dropped, no error
    with pytest.raises(EOFError):  # nothing more, and the pipe closed
        reader.recv()


def test_commands_to_an_engine_slow_to_read_never_stall_the_front_end(tiny_llama):
    """A front end's posts go to its writer thread: with the engine process not reading (its loop busy), 20 adds
    each larger than a pipe's buffer are queued at once (writing in the event loop's thread blocked on the first,
    stalling every stream); read later, they arrive whole and in order, several to a message, and stop() sends
    "stop" after them. Once the pipe is broken, a post raises OSError (the request fails at once)."""
    import threading
    from multiprocessing import Pipe

    from nanovllm.server.engine_core import CoreClient, CoreStart, PoolLimits

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", kvcache_block_size=16, num_gpu_blocks=64)
    bm = llm.block_manager
    reader, writer = Pipe(duplex=False)
    start = CoreStart(llm.config, PoolLimits(bm.num_blocks, bm.num_host_blocks, bm.block_size), llm.stats(), 0, 1)
    client = CoreClient((writer, None), start)
    params = SamplingParams(max_tokens=2)
    prompt = list(range(30_000))  # ~60 KB pickled: a few of them fill the pipe

    def event_loop() -> None:
        for k in range(20):
            client.post(("add", f"r{k}", prompt, params))

    front_end = threading.Thread(target=event_loop, daemon=True)
    front_end.start()
    front_end.join(timeout=5)
    assert not front_end.is_alive(), "the front end blocked on an engine that does not read"
    got = []
    while len(got) < 20:
        message = reader.recv()
        assert isinstance(message, list) and message
        got += message
    assert [c[:2] for c in got] == [("add", f"r{k}") for k in range(20)] and got[0][2] == prompt
    client.stop(timeout=5)
    assert reader.recv() == [("stop",)]
    again = CoreClient((Pipe(duplex=False)[1], None), start)
    deadline = time.monotonic() + 10
    with pytest.raises(OSError):  # its reading end is gone (the engine process died): the writer's send fails
        while time.monotonic() < deadline:
            again.post(("abort", "x"))
            time.sleep(0.01)
