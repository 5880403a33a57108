"""engine/gc_watch.py: the collector's time counted once watched, and a frozen heap skipped by collections."""
from __future__ import annotations

import gc
import weakref

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
    before = gc_watch.seconds()
    gc.collect()
    assert gc_watch.seconds() > before


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
