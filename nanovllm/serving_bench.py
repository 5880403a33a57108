"""Serving benchmark: Poisson arrivals at several request rates against an OpenAI-compatible server.

Per rate: time to first token (TTFT), time per output token after the first (TPOT = (E2E - TTFT) / (n - 1),
as in vLLM's benchmark), end-to-end latency (E2E) at p50/p90/p99, and output throughput. Throughput is
reported next to a peer from the same run: the offline `LLM.generate` on the same prompts (the ceiling
that no arrival rate can beat) when the benchmark starts its own server, else the rate-inf run.
Prompts are random token ids sent as `prompt: [ids]` with `ignore_eos`, so output lengths are exact and
no tokenizer is needed (random-weight models have none).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import gc
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanovllm.server import HTTP_PARSERS, UVICORN_LOOPS
from nanovllm.serving_profile import ServerProfile, find_py_spy, front_end_pids, server_processes


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_workload(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0):
    """Random prompts of input_len ids (from 10 to vocab_size - 10, clear of most special tokens)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(10, vocab_size - 10) for _ in range(input_len)] for _ in range(num_prompts)]
    return prompts, [output_len] * num_prompts


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]  # noqa: E731
    return {"mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


HTTP_CLIENTS = ("aiohttp", "httpx")  # aiohttp, as vLLM's benchmark: ~4x less CPU per streamed token than httpx


def _request_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


class _StreamTimes:
    """A streamed request's result from its SSE lines as they arrive (str or bytes)."""

    def __init__(self) -> None:
        self.result, self.start, self.last = RequestResult(ok=False), time.perf_counter(), None

    def line(self, line: str | bytes) -> None:
        line = line.strip()
        if line[:6] not in ("data: ", b"data: ") or line[6:] in ("[DONE]", b"[DONE]"):
            return
        chunk, now = json.loads(line[6:]), time.perf_counter()
        if chunk.get("usage"):
            self.result.output_tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"]:
            if self.last is None:
                self.result.ttft = now - self.start
            else:
                self.result.itl.append(now - self.last)
            self.last = now

    def done(self) -> RequestResult:
        self.result.e2e, self.result.ok = time.perf_counter() - self.start, True
        return self.result


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """One streamed completion through `client`: an aiohttp.ClientSession or an httpx.AsyncClient."""
    body, times = _request_body(model, prompt, max_tokens), _StreamTimes()
    try:
        if hasattr(client, "stream"):  # httpx
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    times.result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return times.result
                async for line in response.aiter_lines():
                    times.line(line)
        else:
            async with client.post(f"{url}/v1/completions", json=body) as response:
                if response.status != 200:
                    times.result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                    return times.result
                async for line in response.content:
                    times.line(line)
        return times.done()
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        times.result.error = repr(e)
        return times.result


@contextlib.asynccontextmanager
async def http_client(library: str):
    """A client without a connection limit or timeouts, sending the server's API key if one is set."""
    if library == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, headers=auth_headers()) as client:
            yield client
    elif library == "aiohttp":
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(),
                                         timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 20) as client:
            yield client
    else:
        raise ValueError(f"the HTTP client is one of {HTTP_CLIENTS}, got {library!r}")


async def send_all(url: str, model: str, prompts, out_lens, rate: float, seed: int = 0, library: str = "aiohttp"
                   ) -> tuple[list[RequestResult], float, float]:
    """Send every prompt with exponential gaps of mean 1/rate (all at once for rate inf). Returns the results
    and the wall-clock times of the first send and of the last response's end: the client's own set-up (the
    import, the connection pool) is not the server's time."""
    rng = random.Random(seed)
    async with http_client(library) as client:
        start, tasks = time.time(), []
        for prompt, n in zip(prompts, out_lens):
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, n)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        return results, start, time.time()


def client_share(url: str, model: str, prompts, out_lens, rate: float, seed: int, library: str = "aiohttp",
                 ready=None):
    """One client process's share (run in a child): its results, wall-clock start (first send) and end (last
    response), CPU seconds. With `ready` (a barrier of every share), it waits there after its imports."""
    __import__(library)  # before the start, so that the shares' first sends go out together

    if ready is not None:
        ready.wait()
    cpu = time.process_time()
    results, start, end = asyncio.run(send_all(url, model, prompts, out_lens, rate, seed, library))
    return results, start, end, time.process_time() - cpu


def start_together(fn, shares: list[tuple]) -> list:
    """fn(*share, ready) for each share in a spawned process of its own, every one past the barrier `ready`
    only once all have started (a child's start-up, its imports, takes seconds, and as long as one child is
    late the others would load the server alone)."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        ready = manager.Barrier(len(shares))
        return list(pool.map(fn, *zip(*shares), [ready] * len(shares)))


def run_rate(url: str, model: str, prompts, out_lens, rate: float, seed: int = 0, processes: int = 1,
             server_pid: int | None = None, library: str = "aiohttp") -> dict:
    """One rate's run from `processes` client processes (each sends every processes-th prompt at rate /
    processes: together still Poisson at `rate`), with the CPU busy fractions of the client and of the server's
    front-end processes over the run (their sum and the busiest): a client at 1.0 measures itself, not the server."""
    front_ends = front_end_pids(server_pid)
    server_cpu = [process_cpu_seconds(pid) for pid in front_ends]
    steps_before = server_steps(url)
    watch = EngineWatch(url) if steps_before is not None else None
    if processes == 1:
        shares = [client_share(url, model, prompts, out_lens, rate, seed, library)]
    else:
        shares = start_together(client_share, [(url, model, prompts[k::processes], out_lens[k::processes],
                                                rate / processes, seed + k, library) for k in range(processes)])
    starts = [start for _, start, _, _ in shares]
    first_send, last_end = min(starts), max(end for _, _, end, _ in shares)
    duration = last_end - first_send
    summary = summarize(rate, [r for results, *_ in shares for r in results], duration)
    if watch is not None:
        summary["engine_busy_by_tenth"] = watch.stop(first_send, last_end)
    summary["started_at"], summary["ended_at"] = first_send, last_end  # wall clock: to align the server's logs
    summary["client_processes"], summary["http_client"] = processes, library
    summary["client_start_spread_s"] = max(starts) - first_send  # the last client process's first send after the first
    steps_after = server_steps(url)
    if steps_before is not None and steps_after is not None:
        from nanovllm.engine.step_plan import STEP_KINDS

        summary["engine_steps"] = {kind: int(steps_after[kind] - steps_before[kind]) for kind in STEP_KINDS}
        summary["engine_step_s"] = steps_after["seconds"] - steps_before["seconds"]
        if steps_after["gc_seconds"] is not None and steps_before["gc_seconds"] is not None:
            summary["engine_gc_s"] = steps_after["gc_seconds"] - steps_before["gc_seconds"]
        if steps_after["forward_seconds"] is not None and steps_before["forward_seconds"] is not None:
            forward = zip(steps_before["forward_seconds"], steps_after["forward_seconds"])
            summary["engine_forward_s"] = dict(zip(STEP_KINDS, (b - a for a, b in forward)))
    summary["client_cpu_busy"] = sum(cpu for *_, cpu in shares) / (duration * processes)
    busy = [(process_cpu_seconds(pid) - before) / duration for pid, before in zip(front_ends, server_cpu)
            if before is not None and process_cpu_seconds(pid) is not None]
    if busy:
        summary["server_cpu_busy"] = sum(busy)
        summary["server_cpu_busy_max"] = max(busy)
        summary["server_front_ends"] = len(busy)
    return summary


class EngineWatch:
    """The server's engine step seconds (its /metrics), polled every `period` s in a thread over a run: in which
    part of the run the engine worked and where it waited for requests."""

    def __init__(self, url: str, period: float = 0.05):
        import threading

        self.url, self.period, self.samples = url, period, []  # (wall time, engine step seconds so far)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            steps = server_steps(self.url)
            if steps is not None:
                self.samples.append((time.time(), steps["seconds"]))
            self._done.wait(self.period)

    def stop(self, start: float, end: float) -> list[float]:
        """The engine's busy fraction in each tenth of [start, end] (step seconds interpolated between polls)."""
        self._done.set()
        self._thread.join()
        times, seconds = [t for t, _ in self.samples], [s for _, s in self.samples]
        if len(times) < 2:
            return []
        def at(t: float) -> float:
            k = min(max(bisect.bisect_right(times, t), 1), len(times) - 1)
            t0, t1, s0, s1 = times[k - 1], times[k], seconds[k - 1], seconds[k]
            return s0 + (s1 - s0) * min(max((t - t0) / max(t1 - t0, 1e-9), 0.0), 1.0)
        edges = [start + (end - start) * k / 10 for k in range(11)]
        return [round((at(b) - at(a)) / (b - a), 3) for a, b in zip(edges, edges[1:])]  # a step counts at its end


def server_steps(url: str) -> dict[str, float] | None:
    """The server's engine steps so far by kind and the seconds spent in them ("seconds"; its /metrics), or None
    where it has no such metric; "gc_seconds": its engine process's garbage collections (None on a server without
    that metric)."""
    import httpx

    from nanovllm.engine.step_plan import STEP_KINDS
    from nanovllm.server.metrics import parse_metrics

    try:
        metrics = parse_metrics(httpx.get(f"{url}/metrics", timeout=10, headers=auth_headers()).text)
    except (httpx.HTTPError, ValueError):
        return None
    steps = {kind: metrics.get(f'nanovllm:engine_steps_total{{kind="{kind}"}}') for kind in STEP_KINDS}
    steps["seconds"] = metrics.get("nanovllm:engine_step_seconds_total")
    if None in steps.values():
        return None
    steps["gc_seconds"] = metrics.get("nanovllm:engine_gc_seconds_total")
    forward = [metrics.get(f'nanovllm:engine_forward_seconds_total{{kind="{kind}"}}') for kind in STEP_KINDS]
    steps["forward_seconds"] = None if None in forward else forward
    return steps


def wait_front_ends(server_pid: int, count: int, timeout: float = 300.0) -> None:
    """Wait until the server's `count` front-end processes are about to serve (one answering /health is not all)."""
    deadline = time.monotonic() + timeout
    while len(front_end_pids(server_pid)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server's {count} front-end processes did not all start within {timeout:.0f} s")
        time.sleep(0.2)
    time.sleep(0.5)  # from naming itself to accepting connections


def process_cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a process (Linux /proc), None where not readable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": "inf" if rate == math.inf else rate,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "output_tokens": tokens,
        "output_throughput_tok_s": tokens / duration, "request_throughput_req_s": len(ok) / duration,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


# ---- a server of our own, and the offline peer ------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, engine_args: list[str], port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", *([model] if model else []), "--port", str(port),
           "--max-pending-requests", "100000", "--log-level", "warning", *engine_args]
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 900.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def offline_throughput(model: str | None, engine_options: dict, prompts, out_lens, loads: tuple[int, ...] = (0,)
                       ) -> list[dict]:
    """The same prompts through LLM.generate in this process: the ceiling for any arrival rate. One run per entry of
    `loads`, beside that many processes that keep a core busy each (0: alone): what the host's other work (the
    server's clients and front ends share its cores) costs the engine itself. The start-up heap is frozen as in the
    server's engine process, so that neither side meets a full collection over it that the other does not."""
    from nanovllm import LLM
    from nanovllm.engine import gc_watch

    llm = LLM(model, **engine_options)
    gc_watch.freeze_start_up_heap()
    gc_watch.watch()
    try:
        return _offline_runs(llm, prompts, out_lens, loads)
    finally:
        gc.unfreeze()  # the engine's memory is freed with it once this process lets it go


def _offline_runs(llm, prompts, out_lens, loads: tuple[int, ...]) -> list[dict]:
    from nanovllm import SamplingParams
    from nanovllm.engine.step_plan import STEP_KINDS

    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in out_lens]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
    runs = []
    for load in loads:
        before = llm.stats()
        with busy_cores(load):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        tokens, after = sum(len(o.token_ids) for o in outs), llm.stats()
        runs.append({"output_tokens": tokens, "duration_s": seconds, "output_throughput_tok_s": tokens / seconds,
                     "busy_processes": load,
                     "engine_steps": dict(zip(STEP_KINDS, (b - a for a, b in zip(before.steps, after.steps)))),
                     "engine_step_s": after.step_seconds - before.step_seconds,
                     "engine_forward_s": dict(zip(STEP_KINDS, (b - a for a, b in zip(before.forward_seconds,
                                                                                     after.forward_seconds)))),
                     "engine_gc_s": after.gc_seconds - before.gc_seconds})
    return runs


@contextlib.contextmanager
def busy_cores(count: int):
    """`count` processes, each spinning on one core, while the block runs."""
    if count == 0:
        yield
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    stop, spinning = context.Event(), context.Semaphore(0)
    spinners = [context.Process(target=_spin, args=(stop, spinning), daemon=True) for _ in range(count)]
    for process in spinners:
        process.start()
    for _ in spinners:  # started and past their imports
        spinning.acquire()
    try:
        yield
    finally:
        stop.set()
        for process in spinners:
            process.join(10)


def _spin(stop, spinning) -> None:
    spinning.release()
    while not stop.is_set():
        sum(range(10_000))


def auth_headers() -> dict[str, str]:
    """The server's API key from $NANOVLLM_API_KEY (which a server started here reads too), if set."""
    key = os.environ.get("NANOVLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_model(url: str) -> tuple[str, int]:
    import httpx

    card = httpx.get(f"{url}/v1/models", timeout=10, headers=auth_headers()).json()["data"][0]
    return card["id"], card["max_model_len"]


def vocab_size(model: str | None) -> int:
    from nanovllm.config import load_hf_config

    if model is None:
        from nanovllm.models.fetch import default_model_path

        model = str(default_model_path())
    return load_hf_config(model)["vocab_size"]


# ---- report -------------------------------------------------------------------------------
def _steps(run: dict) -> str:
    """', engine steps decode / mixed / prefill a / b / c in S s of the run's T s (M ms each)' where the run
    counted them: the engine's own time per step against the time it left idle."""
    steps = run.get("engine_steps")
    if not steps:
        return ""
    count = sum(steps.values())
    text = f", engine steps {' / '.join(steps)} {' / '.join(str(int(n)) for n in steps.values())}"
    if "engine_step_s" in run and count:
        text += (f" in {run['engine_step_s']:.2f} s of the run's {run['duration_s']:.2f} s "
                 f"({run['engine_step_s'] / count * 1e3:.2f} ms each)")
    if "engine_gc_s" in run:
        text += f", garbage collections {run['engine_gc_s'] * 1e3:.0f} ms"
    forward = run.get("engine_forward_s")
    if forward:
        each = [forward[kind] / steps[kind] * 1e3 if steps.get(kind) else 0.0 for kind in forward]
        text += f"; forward on the host ms per step {' / '.join(f'{ms:.2f}' for ms in each)}"
    return text


def print_report(report: dict) -> None:
    peer = report["peer"]
    print(f"\npeer: {peer['name']} = {peer['output_throughput_tok_s']:.1f} output tok/s{_steps(peer)}")
    loaded = report.get("peer_under_load")
    if loaded:
        print(f"      the same beside {loaded['busy_processes']} busy processes = "
              f"{loaded['output_throughput_tok_s']:.1f} output tok/s ({loaded['fraction_of_peer']:.2f} of alone)")
    print(f"{'rate':>6} {'done':>5} {'tok/s':>9} {'of peer':>8} | {'TTFT p50/p90/p99 ms':>22} | "
          f"{'TPOT p50/p90/p99 ms':>22} | {'E2E p50/p90/p99 s':>20}")
    for r in report["rates"]:
        ms = lambda d: "/".join(f"{d.get(k, float('nan')) * 1e3:.0f}" for k in ("p50", "p90", "p99"))  # noqa: E731
        s = "/".join(f"{r['e2e_s'].get(k, float('nan')):.2f}" for k in ("p50", "p90", "p99"))
        print(f"{r['request_rate']!s:>6} {r['completed']:>5} {r['output_throughput_tok_s']:>9.1f} "
              f"{r['fraction_of_peer']:>8.2f} | {ms(r['ttft_s']):>22} | {ms(r['tpot_s']):>22} | {s:>20}")
        client = f"{r['client_processes']} {r.get('http_client', 'httpx')}"
        busy = f"client CPU busy {r['client_cpu_busy']:.2f} ({client} processes"
        if r["client_processes"] > 1:
            busy += f", first sends within {r['client_start_spread_s'] * 1e3:.0f} ms"
        busy += ")"
        if "server_cpu_busy" in r:
            busy += f", server front end {r['server_cpu_busy']:.2f}"
            if r["server_front_ends"] > 1:
                busy += f" ({r['server_front_ends']} processes, busiest {r['server_cpu_busy_max']:.2f})"
        print(f"       {busy}{_steps(r)}")
        if r.get("engine_busy_by_tenth"):
            print(f"       engine busy by tenths of the run: {' '.join(f'{b:.2f}' for b in r['engine_busy_by_tenth'])}")
        if r["failed"]:
            print(f"       {r['failed']} failed: {r['errors']}")
        for role, found in r.get("profile", {}).items():
            if "error" in found:
                print(f"       profile of the {role}: {found['error']}")
                continue
            print(f"       profile of the {role} ({found['samples']} samples while busy, {found['file']}), own time:")
            for name, share in found["top"]:
                print(f"         {share:6.1%}  {name}")


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no chart")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in report["rates"] if r["request_rate"] != "inf"]
    if not rates:
        return
    x = [r["request_rate"] for r in rates]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, key, title, scale in ((axes[0], "ttft_s", "TTFT (ms)", 1e3), (axes[1], "tpot_s", "TPOT (ms)", 1e3),
                                  (axes[2], "e2e_s", "E2E latency (s)", 1)):
        for q in ("p50", "p90", "p99"):
            ax.plot(x, [r[key].get(q, float("nan")) * scale for r in rates], marker="o", label=q)
        ax.set(title=title, xlabel="request rate (req/s)")
        ax.legend()
    axes[3].plot(x, [r["output_throughput_tok_s"] for r in rates], marker="o", label="served")
    inf_run = next((r for r in report["rates"] if r["request_rate"] == "inf"), None)
    if inf_run is not None:
        axes[3].axhline(inf_run["output_throughput_tok_s"], color="C1", ls=":", label="served, rate inf")
    axes[3].axhline(report["peer"]["output_throughput_tok_s"], color="gray", ls="--", label=report["peer"]["name"])
    axes[3].set(title="output throughput (tok/s)", xlabel="request rate (req/s)")
    axes[3].legend()
    fig.suptitle(report["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_rates(text: str) -> list[float]:
    rates = [math.inf if r.strip() == "inf" else float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--request-rates must be positive numbers or inf, comma-separated; got {text!r}")
    return rates


def run(args: argparse.Namespace, engine_options: dict, engine_args: list[str]) -> dict:
    rates = parse_rates(args.request_rates)
    if args.url is None:
        from nanovllm.server.app import check_api_server_count

        check_api_server_count(args.api_server_count, args.engine_core)
    if args.client_processes < 1:
        raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.profile_server:
        if args.url is not None:
            raise ValueError("--profile-server profiles the server this benchmark starts, not one at --url")
        find_py_spy()
    if math.inf not in rates:
        rates.append(math.inf)  # the peer when no offline run is made, and the served ceiling otherwise
    out_dir = Path(args.output_dir or os.environ.get("OUT") or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server_args = ["--engine-core", args.engine_core, "--api-server-count", str(args.api_server_count),
                       "--uvicorn-loop", args.uvicorn_loop, "--uvicorn-http", args.uvicorn_http]
        proc = start_server(args.model, [*engine_args, *server_args], port, out_dir / "serving_server.log")
    try:
        wait_healthy(url, proc)
        if proc is not None and args.api_server_count > 1:
            wait_front_ends(proc.pid, args.api_server_count)
        model, max_model_len = server_model(url)
        if args.input_len + args.output_len > max_model_len:  # the server would refuse every request
            raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the server's "
                             f"max_model_len={max_model_len}")
        vocab = args.vocab_size or vocab_size(args.model if proc is not None else model)
        prompts, out_lens = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.workload_seed)
        run_rate(url, model, prompts[:2], [4, 4], math.inf, library=args.http_client)  # warm-up
        results = []
        for rate in rates:
            profile = ServerProfile(server_processes(proc.pid), out_dir, args.name) \
                if args.profile_server and rate == math.inf else None
            results.append(run_rate(url, model, prompts, out_lens, rate, args.workload_seed, args.client_processes,
                                    proc.pid if proc is not None else None, args.http_client))
            if profile is not None:
                results[-1]["profile"] = profile.stop()
            print(f"rate {results[-1]['request_rate']}: {results[-1]['output_throughput_tok_s']:.1f} output tok/s, "
                  f"{results[-1]['completed']}/{len(prompts)} completed", flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    inf_run = next(r for r in results if r["request_rate"] == "inf")
    loaded = []
    if proc is not None and not args.no_offline:
        alone, *loaded = offline_throughput(args.model, engine_options, prompts, out_lens,
                                            (0, args.peer_cpu_load) if args.peer_cpu_load else (0,))
        peer = {"name": "offline LLM.generate", **alone}
    else:
        peer = {"name": "rate-inf run",
                **{k: inf_run[k] for k in ("output_tokens", "duration_s", "output_throughput_tok_s")}}
    for r in results:
        r["fraction_of_peer"] = r["output_throughput_tok_s"] / peer["output_throughput_tok_s"]
    report = {"title": f"{model}: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out",
              "model": model, "url": args.url, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "engine_options": engine_options,
              "engine_core": args.engine_core if proc is not None else None,
              "api_server_count": args.api_server_count if proc is not None else None, "peer": peer, "rates": results}
    if loaded:
        report["peer_under_load"] = {**loaded[0], "fraction_of_peer": loaded[0]["output_throughput_tok_s"] /
                                     peer["output_throughput_tok_s"]}
    print_report(report)
    (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / f"{args.name}.png")
    print(f"\nresults written to {out_dir / (args.name + '.json')} and {out_dir / (args.name + '.png')}")
    return report


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="an already running server, e.g. http://127.0.0.1:8000 (default: start one with the "
                             "model and engine options given here)")
    parser.add_argument("--model", default=None, help="HF-format model directory for the server this benchmark "
                                                      "starts (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--request-rates", default="1,4,16,inf",
                        help="comma-separated Poisson arrival rates in requests/s; inf sends all at once; "
                             "an inf run is always added (default: 1,4,16,inf)")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per rate (default: 200)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt length in tokens (default: 256)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: 128)")
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below this "
                                                                     "(default: the model's vocab_size)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of prompts and arrival times (default: 0)")
    parser.add_argument("--no-offline", action="store_true",
                        help="skip the offline LLM.generate peer; throughput is then relative to the rate-inf run")
    parser.add_argument("--output-dir", default=None, help="where the JSON and PNG go (default: $OUT or bench/results)")
    parser.add_argument("--name", default="serving", help="file name stem of the results (default: serving)")
    parser.add_argument("--engine-core", default="process", choices=["process", "thread"],
                        help="the started server's --engine-core (default: process)")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="the started server's --api-server-count: HTTP front-end processes over one engine "
                             "process; 'server front end' then sums them and names the busiest (default: 1)")
    parser.add_argument("--uvicorn-loop", default="auto", choices=UVICORN_LOOPS,
                        help="the started server's --uvicorn-loop (default: auto)")
    parser.add_argument("--uvicorn-http", default="auto", choices=HTTP_PARSERS,
                        help="the started server's --uvicorn-http (default: auto)")
    parser.add_argument("--http-client", default="aiohttp", choices=HTTP_CLIENTS,
                        help="the client's HTTP library (default: aiohttp, as vLLM's benchmark; httpx costs ~4x the "
                             "CPU per streamed token)")
    parser.add_argument("--profile-server", action="store_true",
                        help="sample the started server's processes (engine, each front end) with py-spy during the "
                             "rate-inf run: the functions on top of most samples in the report, raw stacks in "
                             "the output directory (needs py-spy on PATH)")
    parser.add_argument("--peer-cpu-load", type=int, default=0, metavar="N",
                        help="run the offline peer a second time beside N processes that each keep a core busy, as "
                             "the server's clients and front ends do: how much the host's other work slows the "
                             "engine itself (default: 0, not run)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes sharing the requests (one Python client parsing every SSE chunk can "
                             "be the bottleneck: see 'client CPU busy' in the report; default: 1)")


def cmd_bench_serving(args: argparse.Namespace) -> None:
    from nanovllm.engine_args import engine_options

    options = engine_options(args)
    run(args, options, engine_args_from(options))


def engine_args_from(options: dict) -> list[str]:
    """Engine options back to `nanovllm serve` flags."""
    args = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def add_bench_parser(sub) -> None:
    from nanovllm.engine_args import add_engine_options

    bench = sub.add_parser("bench", help="benchmarks (serving: latency and throughput under Poisson load)",
                           description="Benchmarks. `nanovllm bench serving` measures a server under Poisson load.")
    kinds = bench.add_subparsers(dest="bench", required=True)
    serving = kinds.add_parser("serving", help="TTFT, TPOT, E2E percentiles and throughput per request rate",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(serving)
    add_engine_options(serving)
    serving.set_defaults(func=cmd_bench_serving)
