"""bench/quest_reuse.py's count of kept pages that earlier steps kept too, on hand-made selections."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from quest_reuse import reuse  # noqa: E402


def test_reuse_counts_hits_against_the_previous_steps_and_the_cache_they_make():
    steps = [torch.tensor([[1, 2, 3, -1], [7, 8, 9, 10]]),
             torch.tensor([[1, 2, 4, 5], [7, 8, 9, 10]]),
             torch.tensor([[3, 4, 6, -1], [11, 12, 13, 14]])]
    # window 1: step 1 finds 1, 2 of head 0 and all 4 of head 1; step 2 finds 4 of head 0, nothing of head 1
    assert reuse(steps, 1) == (2 + 4 + 1 + 0, 4 + 4 + 3 + 4, 3 + 4 + 4 + 4, 4)
    # window 2 (step 2 only): head 0 finds 3 and 4 among {1, 2, 3, 4, 5}; head 1 none among {7..10}
    assert reuse(steps, 2) == (2, 3 + 4, 5 + 4, 2)
    assert reuse(steps, 3) == (0, 0, 0, 0)
