"""Server metrics in the Prometheus text format (exposition format 0.0.4), written without a client library.

Updated from the engine thread and read by the /metrics handler, so every access holds one lock.
"""
from __future__ import annotations

import bisect
import threading

from nanovllm.engine.llm_engine import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the request failed in the engine


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {cumulative}"]
        return out


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.stats: EngineStats | None = None
        self.pending = 0  # requests accepted by the server and not finished (running + waiting + being admitted)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected = {"invalid": 0, "overloaded": 0}
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)

    def set_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self.stats = stats

    def set_pending(self, pending: int) -> None:
        with self._lock:
            self.pending = pending

    def record_first_token(self, prompt_tokens: int, ttft: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.ttft.observe(ttft)

    def record_tokens(self, new_tokens: int, seconds_since_last: float | None) -> None:
        with self._lock:
            self.generation_tokens += new_tokens
            if seconds_since_last is not None:
                for _ in range(new_tokens):  # one step normally brings one token per sequence
                    self.itl.observe(seconds_since_last / new_tokens)

    def record_finished(self, reason: str, e2e: float) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(e2e)

    def record_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def render(self) -> str:
        with self._lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        s = self.stats
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{labels} {value}" for labels, value in samples)

        metric("nanovllm_requests_running", "gauge", "Requests in the running batch.", [("", s.num_running if s else 0)])
        metric("nanovllm_requests_waiting", "gauge", "Requests queued in the scheduler.", [("", s.num_waiting if s else 0)])
        metric("nanovllm_requests_pending", "gauge", "Requests accepted by the server and not finished.",
               [("", self.pending)])
        metric("nanovllm_kv_blocks_used", "gauge", "KV-cache blocks in use per pool.",
               [('{pool="gpu"}', s.gpu_blocks_used if s else 0), ('{pool="host"}', s.host_blocks_used if s else 0)])
        metric("nanovllm_kv_blocks_total", "gauge", "KV-cache blocks per pool.",
               [('{pool="gpu"}', s.gpu_blocks_total if s else 0), ('{pool="host"}', s.host_blocks_total if s else 0)])
        metric("nanovllm_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
               [("", s.num_preemptions if s else 0)])
        metric("nanovllm_prompt_tokens_total", "counter", "Prompt tokens of requests that started generating.",
               [("", self.prompt_tokens)])
        metric("nanovllm_generation_tokens_total", "counter", "Generated tokens.", [("", self.generation_tokens)])
        metric("nanovllm_requests_finished_total", "counter", "Finished requests by finish reason.",
               [(f'{{finish_reason="{r}"}}', n) for r, n in self.finished.items()])
        metric("nanovllm_requests_rejected_total", "counter", "Requests refused before admission, by reason.",
               [(f'{{reason="{r}"}}', n) for r, n in self.rejected.items()])
        for name, hist, help_ in (
            ("nanovllm_time_to_first_token_seconds", self.ttft, "Time from arrival to the first generated token."),
            ("nanovllm_inter_token_latency_seconds", self.itl, "Time between consecutive generated tokens."),
            ("nanovllm_e2e_request_latency_seconds", self.e2e, "Time from arrival to the end of the request."),
        ):
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)])
        return out


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name with labels -> value, for tests and the benchmark client."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
