"""bench/tensor_parallel.py's agreement report: where a TP size's greedy tokens leave the first size's, and the
top-two logprob gap there (a divergence at a near-tie is rounding between reduction orders, not a bug)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from tensor_parallel import agreement, top_two_gap  # noqa: E402


def test_top_two_gap_is_the_difference_of_the_two_largest_logprobs():
    assert top_two_gap({5: -0.1, 9: -2.6, 3: -0.6}) == -0.1 - -0.6
    assert top_two_gap({1: -0.7, 2: -0.7}) == 0.0


def test_agreement_reports_each_diverging_prompt_with_both_gaps():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    rows = [
        {"tp": 1, "tokens": ref, "gaps": [[0.5, 0.4, 0.3, 0.2], [0.9, 0.01, 0.8, 0.7]]},
        {"tp": 2, "tokens": [[1, 2, 3, 4], [5, 9, 7, 8]], "gaps": [[0.5, 0.4, 0.3, 0.2], [0.9, 0.02, 0.6, 0.5]]},
    ]
    agreement(rows)
    assert rows[0]["greedy_identical"] == "2/2" and rows[0]["divergences"] == []
    assert rows[1]["greedy_identical"] == "1/2"
    assert rows[1]["divergences"] == [{"prompt": 1, "token": 1, "top2_gap": 0.02, "top2_gap_tp1": 0.01}]
    assert "tokens" not in rows[1] and "gaps" not in rows[1]
