"""RULER scoring and reporting against hand-computed cases."""
from __future__ import annotations

import sys

import pytest

from nanovllm.eval.ruler.report import markdown_table, save_chart
from nanovllm.eval.ruler.scoring import (
    clean_prediction,
    passed,
    sample_score,
    string_match_all,
    string_match_part,
    summarize,
)


def test_clean_prediction():
    assert clean_prediction("  \x00abc\tdef\n ") == "abc\ndef"  # strip, control chars -> \n, strip
    assert clean_prediction("a\x1bb\rc") == "a\nb\nc"
    assert clean_prediction("\n\n 1. x\x7f ") == "1. x\x7f"  # DEL is not in [\x00-\x1f]
    assert clean_prediction("") == ""


def test_string_match_all():
    assert string_match_all(["The answer is 123 and 456"], [["123", "456", "789"]]) == pytest.approx(200 / 3)
    assert string_match_all(["a b", "x"], [["a", "b"], ["y"]]) == 50.0  # mean of 100 and 0
    assert string_match_all(["APPLE pie"], [["apple", "Pie"]]) == 100.0  # case-insensitive
    assert string_match_all(["restart"], [["art"]]) == 100.0  # a substring, as in RULER


def test_string_match_part():
    assert string_match_part(["Paris, France"], [["france", "Germany"]]) == 100.0
    assert string_match_part(["Paris", "Rome"], [["paris"], ["Milan", "Turin"]]) == 50.0
    assert string_match_part(["10th century"], [["10th and 11th centuries", "11th"]]) == 0.0


def test_sample_score_cleans_and_picks_the_metric():
    assert sample_score("all", "  1. Apple\x1f2. pear", ["apple", "Pear", "kiwi"]) == pytest.approx(200 / 3)
    assert sample_score("part", " kiwi", ["apple", "Pear", "kiwi"]) == 100.0
    assert sample_score("all", " 7067228.", ["7067228"]) == 100.0
    with pytest.raises(ValueError):
        sample_score("f1", "x", ["x"])


def test_pass_threshold_is_half_the_maximum():
    assert passed(50.0) and passed(100.0)
    assert not passed(49.99) and not passed(0.0)
    assert passed(sample_score("all", "ab", ["a", "b", "c", "d"][:2] + ["z", "y"]))  # 2 of 4 found: 50
    assert not passed(sample_score("all", "a", ["a", "b", "c"]))  # 1 of 3: 33.3


RECORDS = [
    {"task": "niah_single_1", "length": 4096, "score": 100.0},
    {"task": "niah_single_1", "length": 4096, "score": 50.0},
    {"task": "niah_single_1", "length": 4096, "score": 0.0},
    {"task": "qa_1", "length": 4096, "score": 100.0},
    {"task": "niah_single_1", "length": 8192, "score": 25.0},
]


def test_summarize():
    s = summarize(RECORDS)
    assert s["tasks"]["niah_single_1"] == {4096: {"score": 50.0, "passed": 2, "total": 3},
                                           8192: {"score": 25.0, "passed": 0, "total": 1}}
    assert s["tasks"]["qa_1"] == {4096: {"score": 100.0, "passed": 1, "total": 1}}
    # per length: unweighted mean of task scores; pass counts summed
    assert s["lengths"] == {4096: {"score": 75.0, "passed": 3, "total": 4},
                            8192: {"score": 25.0, "passed": 0, "total": 1}}
    assert s["overall"] == {"score": 50.0, "passed": 3, "total": 5}
    third = summarize([{"task": "t", "length": 1, "score": x} for x in (100.0, 100.0, 0.0)])
    assert third["tasks"]["t"][1]["score"] == 66.67  # rounded to 2 decimals


def test_markdown_table():
    table = markdown_table(summarize(RECORDS))
    lines = table.splitlines()
    assert lines[0] == "| task | 4K | 8K |"
    assert lines[1] == "|---|---|---|"
    assert lines[2] == "| niah_single_1 | 50.00 (2/3) | 25.00 (0/1) |"
    assert lines[3] == "| qa_1 | 100.00 (1/1) | - |"
    assert lines[4] == "| **average** | **75.00 (3/4)** | **25.00 (0/1)** |"
    assert "Overall: 50.00 average score, 3/5 samples passed" in table


def test_chart(tmp_path):
    pytest.importorskip("matplotlib")
    path = save_chart(summarize(RECORDS), tmp_path / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.warns(UserWarning, match="matplotlib"):
        assert save_chart(summarize(RECORDS), tmp_path / "c.png") is None
    assert not (tmp_path / "c.png").exists()
