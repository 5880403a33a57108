"""Strict checks of request values, shared by SamplingParams, LLM.generate and the HTTP server.

A value of the wrong type raises `InvalidType` (a TypeError), a value out of range `InvalidValue` (a
ValueError); both carry the offending field in `param` and a message that begins with it. `bool` is
never accepted where a number is expected, integers stay within int64, and numbers must be finite.
"""
from __future__ import annotations

import math
from typing import Any

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


class InvalidType(TypeError):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param} {message}")
        self.param = param


class InvalidValue(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param} {message}")
        self.param = param


def type_name(value: Any) -> str:
    return type(value).__name__


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(name: str, value: Any, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    if not is_int(value):
        raise InvalidType(name, f"must be an integer, got {type_name(value)}")
    if not low <= value <= high:
        raise InvalidValue(name, f"must be an integer in [{_bound(low)}, {_bound(high)}], got {_short(value)}")
    return int(value)


def optional_integer(name: str, value: Any, low: int, high: int = INT64_MAX) -> int | None:
    return None if value is None else integer(name, value, low, high)


def number(name: str, value: Any, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
    """A finite float from an int or float; [low, high], or (low, high] with low_open."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidType(name, f"must be a number, got {type_name(value)}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond float's range
        result = math.inf
    if not math.isfinite(result):
        raise InvalidValue(name, f"must be a finite number, got {_short(value)}")
    if result < low or (low_open and result == low) or result > high:
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}]" if high != math.inf else \
            f"{'>' if low_open else '>='} {low:g}"
        raise InvalidValue(name, f"must be {interval}, got {result!r}")
    return result


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidType(name, f"must be a boolean, got {type_name(value)}")
    return value


def text(name: str, value: Any, allow_empty: bool = True) -> str:
    """A str that is valid Unicode (no lone surrogates, so it can be tokenized and encoded as UTF-8)."""
    if not isinstance(value, str):
        raise InvalidType(name, f"must be a string, got {type_name(value)}")
    if not value and not allow_empty:
        raise InvalidValue(name, "must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidValue(name, f"is not valid Unicode: lone surrogate {value[e.start]!r} at index {e.start}") from None
    return value


def strings(name: str, value: Any) -> list[str]:
    """None, one non-empty string, or a list/tuple of them -> a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [text(name, value, allow_empty=False)]
    if not isinstance(value, (list, tuple)):
        raise InvalidType(name, f"must be a string or a list of strings, got {type_name(value)}")
    return [text(f"{name}[{i}]", s, allow_empty=False) for i, s in enumerate(value)]


def _plain_ints(value: list | tuple) -> bool:
    """Every item an int and not a subclass (no bool), checked at C speed: a 32K-token prompt went through
    the per-item loop below twice per request (~20 ms); lists this says no to take that loop."""
    return set(map(type, value)) == {int}


def token_ids(name: str, value: Any) -> list[int]:
    """A list/tuple of non-negative int64 integers -> a list."""
    if not isinstance(value, (list, tuple)):
        raise InvalidType(name, f"must be a list of integers, got {type_name(value)}")
    return _checked_ids(name, value, _plain_ints(value))


def _checked_ids(name: str, value: list | tuple, plain: bool) -> list[int]:
    """token_ids() once the container is checked; plain: _plain_ints(value)."""
    if plain and min(value) >= 0 and max(value) <= INT64_MAX:
        return list(value)
    for i, t in enumerate(value):
        if not is_int(t):
            raise InvalidType(f"{name}[{i}]", f"must be an integer, got {type_name(t)}")
        if not 0 <= t <= INT64_MAX:
            raise InvalidValue(f"{name}[{i}]", f"must be an integer in [0, 2**63 - 1], got {_short(t)}")
    return list(value)


PROMPT_TYPES = "a str or a list of int token ids"


def prompt(value: Any, name: str = "prompt") -> str | list[int]:
    """One prompt: a str (valid Unicode) or a list/tuple of token ids."""
    if isinstance(value, str):
        return text(name, value)
    if isinstance(value, (list, tuple)):
        plain = _plain_ints(value)
        if not plain and any(not is_int(t) for t in value):
            bad = next(t for t in value if not is_int(t))
            raise InvalidType(name, f"must be {PROMPT_TYPES}, got a list holding {type_name(bad)}")
        return _checked_ids(name, value, plain)
    raise InvalidType(name, f"must be {PROMPT_TYPES}, got {type_name(value)}")


def prompts(value: Any) -> list[str | list[int]]:
    """generate()'s prompts: one prompt, or a list/tuple of prompts -> a list of prompts."""
    if isinstance(value, str):
        return [prompt(value)]
    if not isinstance(value, (list, tuple)):
        raise InvalidType("prompts", f"must be {PROMPT_TYPES}, or a list/tuple of those; got {type_name(value)}")
    if value and (_plain_ints(value) or all(isinstance(t, int) for t in value)):
        return [prompt(value)]  # a single prompt given as token ids (a bool among them is refused there)
    return [prompt(p, f"prompts[{i}]") for i, p in enumerate(value)]


def _bound(limit: int) -> str:
    return {INT64_MAX: "2**63 - 1", INT64_MIN: "-2**63"}.get(limit, str(limit))


def _short(value: int | float) -> str:
    """A number for a message, without printing thousands of digits."""
    s = repr(value)
    return s if len(s) <= 40 else f"{s[:20]}...({len(s)} digits)"
