"""`Prefix`: the first n items of a list that only grows, as a read-only sequence made in O(1).

The front end rebuilds a request's cumulative output every step from the tokens that are new. A copy of the whole
token list per step made a request's streaming cost quadratic in its length (43 us a step at 32K output tokens,
against ~50 us for everything else a streamed token costs); a `Prefix` of the one list the request appends to
stays what it was when made, as a copy would, without the copy. Slices are lists of just their items.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any


class Prefix(Sequence):
    __slots__ = ("_items", "_length")

    def __init__(self, items: list, length: int | None = None):
        """items: a list that is only ever appended to; length: how many of its first items this holds (all)."""
        self._items = items
        self._length = len(items) if length is None else length
        if not 0 <= self._length <= len(items):
            raise ValueError(f"length must be in [0, {len(items)}], got {length}")

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step == 1:
                return self._items[start:stop]
            return [self._items[i] for i in range(start, stop, step)]  # a stop of -1 would wrap as a slice
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError("Prefix index out of range")
        return self._items[position]

    def __iter__(self) -> Iterator:
        return islice(self._items, self._length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other))

    __hash__ = None  # as a list's: equal to a list with the same items

    def __add__(self, other: Sequence) -> list:
        return [*self, *other]

    def __radd__(self, other: Sequence) -> list:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"Prefix({list(self)!r})"
