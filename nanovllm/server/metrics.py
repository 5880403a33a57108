"""Server metrics through prometheus_client: vLLM's metric names with the `nanovllm:` prefix and a `model_name`
label, plus our own (requests pending and refused, KV blocks per pool, host KV bytes read, failed requests).

Each server has its own CollectorRegistry, so several servers can live in one process (tests). Updated from the
engine and output threads, read by the /metrics handler (prometheus_client's metrics are thread-safe).
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from nanovllm.engine.llm_engine import EngineStats
from nanovllm.engine.step_plan import STEP_KINDS

PREFIX = "nanovllm:"
# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")  # as vLLM's request_success; failed requests count in request_errors
REJECT_REASONS = ("invalid", "overloaded")
POOLS = ("gpu", "host")
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str):
        prometheus_client.disable_created_metrics()  # no *_created samples, as vLLM
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._last_preemptions = 0
        self._last_steps = (0,) * len(STEP_KINDS)
        self._last_forward_seconds = (0.0,) * len(STEP_KINDS)
        self._last_step_seconds = 0.0
        self._last_gc_seconds = 0.0
        self.running = self._gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.pending = self._gauge("num_requests_pending", "Requests accepted by the server and not finished.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = self._counter("prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = self._counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = self._counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        self.success = self._labelled(Counter, "request_success", "Count of successfully processed requests.",
                                      "finished_reason", FINISHED_REASONS)
        self.errors = self._counter("request_errors", "Requests that failed in the engine.")
        self.rejected = self._labelled(Counter, "requests_rejected", "Requests refused before admission, by reason.",
                                       "reason", REJECT_REASONS)
        self.blocks_used = self._labelled(Gauge, "kv_blocks_used", "KV-cache blocks in use per pool.", "pool", POOLS)
        self.blocks_total = self._labelled(Gauge, "kv_blocks_total", "KV-cache blocks per pool.", "pool", POOLS)
        self.host_bytes = self._counter("host_kv_bytes_read", "KV bytes copied from the host pool to the device.")
        self.steps = self._labelled(Counter, "engine_steps", "Engine steps by kind: decode rows only (run in CUDA "
                                    "graphs), mixed (prefill and decode rows), prefill rows only.", "kind", STEP_KINDS)
        self.forward_seconds = self._labelled(Counter, "engine_forward_seconds", "Host time in the steps' forward "
                                              "passes by step kind: with CUDA, launching their kernels or replaying "
                                              "their graph.", "kind", STEP_KINDS)
        self.step_seconds = self._counter("engine_step_seconds", "Wall time the engine loop spent in steps "
                                          "(its busy time: the rest it waited for requests).")
        self.gc_seconds = self._counter("engine_gc_seconds", "Wall time the engine process spent in Python's cyclic "
                                        "garbage collections (the engine loop stands still meanwhile).")
        self.ttft = self._histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                   ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                   REQUEST_LATENCY_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)

    def _gauge(self, name: str, doc: str):
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str):
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _labelled(self, kind, name: str, doc: str, label: str, values: tuple[str, ...]) -> dict:
        metric = kind(PREFIX + name, doc, ["model_name", label], registry=self.registry)
        return {value: metric.labels(self.model_name, value) for value in values}

    # ---- updates ---------------------------------------------------------------------------------------------------
    def set_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.gpu_blocks_used / stats.gpu_blocks_total if stats.gpu_blocks_total else 0.0)
        for pool, used, total in (("gpu", stats.gpu_blocks_used, stats.gpu_blocks_total),
                                  ("host", stats.host_blocks_used, stats.host_blocks_total)):
            self.blocks_used[pool].set(used)
            self.blocks_total[pool].set(total)
        if stats.num_preemptions > self._last_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
        self._last_preemptions = stats.num_preemptions
        _add_by_kind(self.steps, stats.steps, self._last_steps)
        self._last_steps = stats.steps
        _add_by_kind(self.forward_seconds, stats.forward_seconds, self._last_forward_seconds)
        self._last_forward_seconds = stats.forward_seconds
        if stats.step_seconds > self._last_step_seconds:
            self.step_seconds.inc(stats.step_seconds - self._last_step_seconds)
            self._last_step_seconds = stats.step_seconds
        if stats.gc_seconds > self._last_gc_seconds:
            self.gc_seconds.inc(stats.gc_seconds - self._last_gc_seconds)
            self._last_gc_seconds = stats.gc_seconds

    def set_pending(self, pending: int) -> None:
        self.pending.set(pending)

    def record_scheduled(self, queue_time: float) -> None:
        self.queue.observe(queue_time)

    def record_first_token(self, prompt_tokens: int, cached_tokens: int, ttft: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        self.ttft.observe(ttft)

    def record_tokens(self, new_tokens: int, seconds_since_last: float | None) -> None:
        self.generation_tokens.inc(new_tokens)
        if seconds_since_last is not None:
            for _ in range(new_tokens):  # one step normally brings one token per sequence
                self.itl.observe(seconds_since_last / new_tokens)

    def record_host_bytes(self, num_bytes: int) -> None:
        if num_bytes > 0:
            self.host_bytes.inc(num_bytes)

    def record_finished(self, reason: str, e2e: float) -> None:
        if reason in self.success:
            self.success[reason].inc()
        else:
            self.errors.inc()
        self.e2e.observe(e2e)

    def record_rejected(self, reason: str) -> None:
        self.rejected[reason].inc()

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name with its labels but model_name -> value (Prometheus' own parser), for tests and clients:
    'nanovllm:prompt_tokens_total', 'nanovllm:request_success_total{finished_reason="stop"}'."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def _add_by_kind(counters: dict, now: tuple, before: tuple) -> None:
    """Each step kind's counter grows by what the engine's running total gained since `before`."""
    for kind, total, last in zip(STEP_KINDS, now, before):
        if total > last:
            counters[kind].inc(total - last)
