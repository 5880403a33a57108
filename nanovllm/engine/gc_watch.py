"""Python's cyclic garbage collector in a long-lived engine process: the time it takes, and the start-up heap kept
out of its reach.

An engine holds ~450K container objects once built (modules, the tokenizer, torch's and transformers' own), and a
full collection walks every one of them: ~190 ms on the 2-core VM for SmolLM2 on the CPU, during which the engine
loop stands still. Freezing the heap after start-up (`freeze_start_up_heap`, as vLLM's engine core does) leaves the
collector only what was allocated since. Collections are process-wide, so the count is too: `watch()` starts it once
per process, and `seconds()` reads it (0.0 where nothing watches).
"""
from __future__ import annotations

import gc
import time


class _Watch:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.full_collections = 0  # of the oldest generation: the ones that walk the whole heap
        self.full_seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.seconds += took
        if info["generation"] == 2:
            self.full_collections += 1
            self.full_seconds += took


_watch: _Watch | None = None


def watch() -> None:
    """Count the time of every collection in this process from now on (once per process)."""
    global _watch
    if _watch is None:
        _watch = _Watch()
        gc.callbacks.append(_watch)


def seconds() -> float:
    """Wall time spent in collections since `watch()`; 0.0 without it."""
    return _watch.seconds if _watch is not None else 0.0


def full_collections() -> tuple[int, float]:
    """(count, wall seconds) of the full collections since `watch()`; (0, 0.0) without it."""
    return (_watch.full_collections, _watch.full_seconds) if _watch is not None else (0, 0.0)


def freeze_start_up_heap() -> int:
    """Collect once, then move every object alive into the permanent generation, which collections skip. For a
    process that builds one engine and serves with it until it exits: what start-up made stays for good anyway.
    Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
