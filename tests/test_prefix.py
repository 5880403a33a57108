"""`server.prefix.Prefix`: a snapshot of a growing list's first items, against a copy made at the same moment."""
from __future__ import annotations

import pytest

from nanovllm.server.prefix import Prefix


def test_a_prefix_stays_what_a_copy_made_then_is_while_the_list_grows():
    items = [5, 6, 7]
    snapshot, copy = Prefix(items), list(items)
    items += [8, 9]
    for i in range(-3, 3):
        assert snapshot[i] == copy[i]
    for bounds in [(None, None), (1, None), (None, -1), (-2, None), (0, 10), (5, 9), (None, None, -1), (0, 3, 2)]:
        assert snapshot[slice(*bounds)] == copy[slice(*bounds)], bounds
    assert len(snapshot) == 3 and list(snapshot) == copy and snapshot == copy and copy == snapshot
    assert snapshot != [5, 6, 7, 8] and snapshot != "abc"
    assert [1] + snapshot == [1, 5, 6, 7] and snapshot + [1] == [5, 6, 7, 1]
    assert type(snapshot[1:]) is list and bool(Prefix(items, 0)) is False
    with pytest.raises(IndexError):
        snapshot[3]
    with pytest.raises(IndexError):
        snapshot[-4]
    with pytest.raises(ValueError, match=r"length must be in \[0, 5\], got 6"):
        Prefix(items, 6)
