"""The offload strategies' stream and event ordering, checked on the CPU.

The host pool is given fake copy streams, so that the strategies take their CUDA branches (side streams,
events, waits), while every operation still runs synchronously on the CPU. A recorder keeps a vector
clock per stream (torch.cuda.Event / wait_event / wait_stream semantics; the host joins the compute
stream when a step's tokens are read) and logs every byte range of the device KV cache, the pinned host
pool and the ring that a copy, an index_copy_, an index_select or an attention call reads or writes, on
the stream it was issued to. Two accesses to overlapping bytes, one of them a write, on different streams
with neither ordered before the other are a race: on a GPU the copy engines could run them in either order.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.worker import Worker
from nanovllm.layers.attention import TorchPagedAttention

BS = 16
PROMPTS = [list(range(3, 150)), [7] * 40 + list(range(60)), list(range(200, 20, -1))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


class FakeStream:
    def __init__(self, recorder: StreamRecorder, name: str):
        self.recorder, self.name = recorder, name
        self.clock: dict[str, int] = {}

    def wait_event(self, event: FakeEvent) -> None:
        self.clock = _join(self.clock, event.clock)

    def wait_stream(self, other: FakeStream) -> None:
        self.clock = _join(self.clock, other.clock)


class FakeEvent:
    def __init__(self, recorder: StreamRecorder):
        self.recorder, self.clock = recorder, {}

    def record(self, stream: FakeStream | None = None) -> None:
        self.clock = dict((stream or self.recorder.current).clock)


def _join(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


class StreamRecorder:
    def __init__(self):
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.host: dict[str, int] = {}  # what the host has waited for
        self.storages: dict[int, str] = {}  # data_ptr of a watched storage -> its name
        self.log: dict[str, list[tuple[int, int, bool, str, dict[str, int], str]]] = {}
        self.races: list[str] = []

    def watch(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.numel():
            self.storages[tensor.untyped_storage().data_ptr()] = name

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None):
        previous, self.current = self.current, stream or self.current
        try:
            yield
        finally:
            self.current = previous

    def sync_host(self) -> None:
        """The host waited for the compute stream (a step's tokens read back)."""
        self.host = _join(self.host, self.compute.clock)

    def access(self, tensor: torch.Tensor, write: bool, what: str, rows: torch.Tensor | None = None) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.numel():
            return
        name = self.storages.get(tensor.untyped_storage().data_ptr())
        if name is None:
            return
        base, size = tensor.untyped_storage().data_ptr(), tensor.element_size()
        start = tensor.data_ptr() - base
        if rows is not None:  # rows of dim 0
            row_bytes = tensor.stride(0) * size
            ranges = [(start + r * row_bytes, start + (r + 1) * row_bytes) for r in rows.tolist()]
        else:
            span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
            ranges = [(start, start + span * size)]
        stream = self.current
        stream.clock = _join(stream.clock, self.host)  # issued after what the host waited for
        stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
        clock = dict(stream.clock)
        log = self.log.setdefault(name, [])
        for lo, hi in ranges:
            for plo, phi, pwrite, pstream, pclock, pwhat in log:
                if phi <= lo or hi <= plo or not (write or pwrite) or pstream == stream.name:
                    continue
                if pclock[pstream] > clock.get(pstream, 0):  # the earlier access is not ordered before this one
                    self.races.append(f"{name}[{lo}:{hi}] {'write' if write else 'read'} by {what} on {stream.name} "
                                      f"unordered with {'write' if pwrite else 'read'} by {pwhat} on {pstream}")
            log.append((lo, hi, write, stream.name, clock, what))


@pytest.fixture
def recorder(monkeypatch):
    rec = StreamRecorder()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec.current)
    monkeypatch.setattr(torch.cuda, "stream", rec.stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(rec))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    copy_, index_copy_, index_select = torch.Tensor.copy_, torch.Tensor.index_copy_, torch.Tensor.index_select

    def copy(self, src, non_blocking=False):
        rec.access(src, False, "copy_")
        rec.access(self, True, "copy_")
        return copy_(self, src, non_blocking)

    def index_copy(self, dim, index, source):
        rec.access(source, False, "index_copy_")
        rec.access(self, True, "index_copy_", index if dim == 0 else None)
        return index_copy_(self, dim, index, source)

    def select(self, dim, index):
        rec.access(self, False, "index_select", index if dim == 0 else None)
        return index_select(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    monkeypatch.setattr(torch.Tensor, "index_copy_", index_copy)
    monkeypatch.setattr(torch.Tensor, "index_select", select)
    for method in ("forward", "forward_with_lse", "history_attention"):
        monkeypatch.setattr(TorchPagedAttention, method, _reading(rec, method, getattr(TorchPagedAttention, method)))
    for method in ("execute", "launch"):
        monkeypatch.setattr(Worker, method, _stepping(rec, getattr(Worker, method)))
    return rec


def _reading(rec: StreamRecorder, name: str, inner):
    """An attention call that first logs its reads of the caches (and of a host pool read in place)."""
    def reading(self, q, k_cache, v_cache, meta, scale, *args, **kwargs):
        rec.access(k_cache, False, name)
        rec.access(v_cache, False, name)
        host_kv = kwargs.get("host_kv")
        if host_kv is not None:
            rec.access(host_kv[0], False, name)
            rec.access(host_kv[1], False, name)
        return inner(self, q, k_cache, v_cache, meta, scale, *args, **kwargs)

    return reading


def _stepping(rec: StreamRecorder, inner):
    def stepping(self, plan):
        out = inner(self, plan)
        rec.sync_host()  # the step's tokens (and logprobs) are read on the host
        return out

    return stepping


def with_fake_streams(llm: LLM, rec: StreamRecorder) -> LLM:
    pool = llm.runner.host_pool
    pool.h2d_stream, pool.d2h_stream = FakeStream(rec, "h2d"), FakeStream(rec, "d2h")
    assert pool.cuda  # the strategies now take their CUDA branches
    rec.watch("device KV", pool.device_cache.data)
    rec.watch("host KV", pool.host)
    rec.watch("ring", pool.ring)
    rec.watch("mirror", pool.mirror)
    return llm


def offload(path, **options) -> LLM:
    return LLM(str(path), kvcache_block_size=BS, device="cpu", num_gpu_blocks=8, enable_cpu_offload=True,
               cpu_kv_cache_gb=0.01, max_num_batched_tokens=64, dtype="float32", **options)


XATTN = {"sparse_policy": "xattention", "sparse_min_context": 0, "xattn_block_size": 16, "xattn_stride": 4}
QUEST = {"sparse_policy": "quest", "sparse_min_context": 0, "quest_token_budget": 2 * BS, "quest_dense_layers": 1}


@pytest.mark.parametrize("options", [
    {},
    {"staged": False},
    {**XATTN, "xattn_threshold": 1.0},
    {**XATTN, "xattn_threshold": 0.5},
    QUEST,
], ids=["dense-staged", "dense-split", "xattention-1.0", "xattention-0.5", "quest"])
def test_offload_copies_are_ordered_with_their_readers_and_writers(tiny_llama, recorder, options):
    options = dict(options)
    staged = options.pop("staged", True)
    llm = with_fake_streams(offload(tiny_llama, **options), recorder)
    llm.runner.staged_decode = staged
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(g.token_ids) == GREEDY.max_tokens for g in got)
    stats = llm.runner.host_pool.stats
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0  # blocks moved out and read back
    assert not recorder.races, "\n".join(recorder.races[:20])


def test_the_recorder_finds_a_missing_wait(tiny_llama, recorder, monkeypatch):
    """Without the wait for a layer's device->host copy, that layer's KV write races with it."""
    from nanovllm.engine.offload import split

    def store_without_wait(self, layer, k, v, slots):
        self.cache.write(layer, k, v, slots)

    monkeypatch.setattr(split._OffloadKV, "_store", store_without_wait)
    llm = with_fake_streams(offload(tiny_llama), recorder)
    llm.runner.staged_decode = False
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert any("device KV" in r and "d2h" in r for r in recorder.races)
