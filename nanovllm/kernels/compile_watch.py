"""Triton kernel variants compiled (or loaded from Triton's disk cache) in this process, as they happen.

Triton compiles a kernel per specialisation: constexpr values, argument dtypes, 16-byte alignment of
pointers, integers equal to 1 or divisible by 16. A variant a request meets first is compiled while that
request waits (seconds on a cold cache). The engine starts the watch before it builds its model and calls
`serving()` once start-up (weights, warm-up forward, CUDA graphs) is done; every later compilation is
logged as a warning naming the kernel and its specialisation, and counted. The hooks are Triton's own,
process-wide settings, hence one watch per process (`WATCH`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("nanovllm.kernels")


@dataclass
class CompileEvent:
    kernel: str
    signature: str  # Triton's description: launch options and each argument's type and specialisation
    seconds: float
    on_request_path: bool


class CompileWatch:
    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self.on_request_path = False
        self._start_index = 0
        self._started: dict[str, float] = {}
        self._chained: tuple | None = None  # the hooks found at install(), called too

    def install(self) -> bool:
        """Set Triton's compile hooks (once); False where Triton is not installed."""
        try:
            from triton import knobs
        except ImportError:
            return False
        if self._chained is None:
            runtime = knobs.runtime
            self._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return True

    def starting(self) -> None:
        """An engine starts: compilations until serving() are its start-up's."""
        self.on_request_path = False
        self._start_index = len(self.events)

    def serving(self) -> None:
        """Start-up is over: compilations from now on are on the request path."""
        startup = [e for e in self.events[self._start_index:] if not e.on_request_path]
        if startup:
            logger.info("start-up compiled or loaded %d Triton kernel variants in %.1f s", len(startup),
                        sum(e.seconds for e in startup))
        self.on_request_path = True

    def request_path_events(self) -> list[CompileEvent]:
        return [e for e in self.events if e.on_request_path]

    def _before(self, *, repr: str, **kwargs):  # noqa: A002 - Triton's keyword
        self._started[repr] = time.perf_counter()
        previous = self._chained[0] if self._chained else None
        return previous(repr=repr, **kwargs) if previous else None  # a true value would skip the compilation

    def _after(self, *, repr: str, fn, **kwargs):  # noqa: A002
        seconds = time.perf_counter() - self._started.pop(repr, time.perf_counter())
        event = CompileEvent(fn.name, describe(repr, kwargs.get("compile")), seconds, self.on_request_path)
        self.events.append(event)
        if event.on_request_path:
            logger.warning("Triton compiled %s on the request path in %.0f ms: %s", fn.name, 1e3 * seconds,
                           event.signature)
        previous = self._chained[1] if self._chained else None
        return previous(repr=repr, fn=fn, **kwargs) if previous else None


def describe(repr: str, compile: dict | None) -> str:  # noqa: A002
    """Launch options and what the variant is specialised on. Triton 3.6's own repr lists the arguments
    wrongly ("q_ptr: ()"), so the argument types, constexpr values and integer/pointer specialisations
    (divisible by 16, equal to 1) come from the compile keywords."""
    if not compile:
        return repr
    configs = compile.get("configs") or [{}]
    return (f"{repr.split('](')[0]}](signature={compile.get('signature')}, constants={compile.get('constants')}, "
            f"specialisation={configs[0]})")


WATCH = CompileWatch()
