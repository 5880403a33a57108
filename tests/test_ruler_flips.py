"""flips.py: per-sample pass -> fail / fail -> pass counts against a reference run, and issue #14's targets."""
from __future__ import annotations

import gzip
import json

from nanovllm.eval.ruler.flips import flip_table, flips, hf_run, main, run_from_records


def records(passes: list[bool], predictions: list[str] | None = None) -> list[dict]:
    predictions = predictions or [f"p{i}" for i in range(len(passes))]
    return [{"task": "niah_single_1" if i % 2 else "vt", "length": 16384, "index": i // 2, "passed": p,
             "score": 100.0 if p else 0.0, "prediction": predictions[i], "prompt": "long " * 10}
            for i, p in enumerate(passes)]


def test_counts_each_direction_and_identical_predictions():
    ref = run_from_records(records([True, True, False, False, True, False]), "ref")
    run = run_from_records(records([False, True, True, True, True, False],
                                   ["x", "p1", "y", "z", "p4", "p5"]), "run")
    f = flips(ref, run)
    assert (f.lost, f.gained, f.identical, f.common, f.passed, ref.passed) == (1, 2, 3, 6, 4, 3)
    assert run.average == (100 * 2 / 3 + 100 * 2 / 3) / 2  # two cells of three samples, 2 pass in each


def test_targets_pass_count_and_one_way_drift():
    ref = run_from_records(records([True] * 10 + [False] * 10), "ref")
    balanced = run_from_records(records([False] * 4 + [True] * 6 + [True] * 3 + [False] * 7), "balanced")
    one_way = run_from_records(records([False] * 5 + [True] * 5 + [True] * 1 + [False] * 9), "one-way")
    few = run_from_records(records([False] * 2 + [True] * 8 + [False] * 10), "few")
    assert flips(ref, balanced).meets_targets(ref.passed)  # 4 lost, 3 gained
    assert not flips(ref, one_way).meets_targets(ref.passed)  # 5 lost, 1 gained: 4 fewer passes
    assert flips(ref, few).meets_targets(ref.passed)  # 2 fewer, under 6 flips
    table = flip_table(ref, [balanced, one_way])
    assert "| balanced | 9 |" in table and "| one-way | 6 |" in table and table.count("| no |") == 1


def test_hf_predictions_of_a_checked_run_form_a_run(tmp_path):
    recs = records([True, False])
    assert hf_run(recs) is None
    for r, s in zip(recs, (0.0, 100.0)):
        r.update(hf_prediction=f"hf{s}", hf_score=s)
    hf = hf_run(recs)
    assert hf.name == "HF" and [s["passed"] for s in hf.samples.values()] == [False, True]


def test_command_prints_the_table_and_writes_compact_runs(tmp_path, capsys):
    for name, passes in (("a", [True, False]), ("b", [False, False])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ruler.json").write_text(json.dumps({"samples": records(passes)}))
    main([str(tmp_path / "a" / "ruler.json"), str(tmp_path / "b" / "ruler.json"), "--compact", str(tmp_path / "c")])
    assert "| b | 0 |" in capsys.readouterr().out
    kept = json.loads((tmp_path / "c" / "b.json").read_text())
    assert len(kept) == 2 and "prompt" not in kept[0]
    main([str(tmp_path / "c" / "a.json"), str(tmp_path / "c" / "b.json"), "--names", "a", "b"])  # compact files read back
    assert "| b | 0 |" in capsys.readouterr().out
    (tmp_path / "c" / "b.json.gz").write_bytes(gzip.compress((tmp_path / "c" / "b.json").read_bytes()))
    main([str(tmp_path / "c" / "a.json"), str(tmp_path / "c" / "b.json.gz"), "--names", "a", "b"])  # gzipped too
    assert "| b | 0 |" in capsys.readouterr().out
