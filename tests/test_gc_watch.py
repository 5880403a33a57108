"""engine/gc_watch.py: the collector's time counted once watched, and a frozen heap skipped by collections."""
from __future__ import annotations

import gc
import weakref

import pytest

from nanovllm.engine import gc_watch


class _Node:
    pass


def _cycle() -> _Node:
    node = _Node()
    node.self = node  # once dropped, only the cyclic collector frees it
    return node


def test_watched_collections_add_their_time():
    gc_watch.watch()
    gc_watch.watch()  # once per process: a second call adds no second callback
    assert sum(callback is gc_watch._watch for callback in gc.callbacks) == 1
    before, (full, full_seconds) = gc_watch.seconds(), gc_watch.full_collections()
    gc.collect()  # a full one
    assert gc_watch.seconds() > before
    count, seconds = gc_watch.full_collections()
    assert count == full + 1 and seconds > full_seconds
    gc.collect(0)  # the youngest generation alone: not a full one
    assert gc_watch.full_collections()[0] == count


def test_a_frozen_heap_is_skipped_by_collections():
    held = _cycle()
    try:
        assert gc_watch.freeze_start_up_heap() > 0
        frozen, later = weakref.ref(held), weakref.ref(_cycle())
        del held  # garbage now, but frozen: collections leave it
        gc.collect()
        assert later() is None  # made after the freeze: collected
        assert frozen() is not None
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen() is None


def test_serve_freezes_the_front_ends_heap_before_it_serves(tiny_llama, monkeypatch):
    """`nanovllm serve` (and each front end of several): the server built, its heap frozen before the first
    request (a full collection over a front end's ~460K objects would stall every stream)."""
    pytest.importorskip("uvicorn")
    from nanovllm import LLM
    from nanovllm.server import app

    seen = []
    monkeypatch.setattr(app._DrainingServer, "run", lambda self, sockets=None: seen.append(gc.get_freeze_count()))
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_gpu_blocks=16, kvcache_block_size=16)
    try:
        app.serve(llm, "127.0.0.1", 0)
    finally:
        gc.unfreeze()
    assert seen and seen[0] > 10_000
