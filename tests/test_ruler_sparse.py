"""nanovllm.eval.ruler.sparse: dense and sparse policies over the same RULER samples, one table."""
from __future__ import annotations

import json

import pytest

from nanovllm.eval.ruler.sparse import main, sparse_table


def result(scores: dict[str, float], prefill: float = 1.0, length=4096) -> dict:
    tasks = {t: {length: {"score": s, "passed": int(s >= 50), "total": 1}} for t, s in scores.items()}
    mean, passed = sum(scores.values()) / len(scores), sum(s >= 50 for s in scores.values())
    return {"summary": {"tasks": tasks, "lengths": {length: {"score": mean, "passed": passed, "total": len(scores)}}},
            "attention": {str(length): {"prefill_density": prefill, "decode_density": 1.0, "host_kv_gb": 0.0}}}


def test_table_shows_each_policy_against_full_and_its_worst_tasks():
    table = sparse_table({"full": result({"vt": 100.0, "qa_1": 50.0, "cwe": 0.0}),
                          "xattention": result({"vt": 40.0, "qa_1": 50.0, "cwe": 10.0}, prefill=0.3)})
    assert "| full | 4096 | 50.00 (2/3) |  |" in table
    assert "| xattention | 4096 | 33.33 (1/3) | -16.67 | 0.300 |" in table
    assert "- xattention: vt 4096 -60.0, qa_1 4096 +0.0, cwe 4096 +10.0" in table


def test_runs_made_apart_combine_into_one_table(tmp_path, capsys):
    """bench/device/sparse_table.sh runs a process per policy and length; --combine makes the issue's one table
    from their sparse.json files (as JSON gives them back: lengths as strings), full first, lengths in order."""
    runs = {"quest_8k": {"quest": result({"vt": 0.0, "cwe": 50.0}, length="8192")},
            "full_8k": {"full": result({"vt": 100.0, "cwe": 50.0}, length="8192")},
            "full_4k": {"full": result({"vt": 100.0, "cwe": 100.0}, length="4096")},
            "quest_4k": {"quest": result({"vt": 100.0, "cwe": 50.0}, length="4096")},
            "quest_4k_b8192": {"quest [quest_token_budget=8192]": result({"vt": 100.0, "cwe": 100.0}, length="4096")}}
    files = []
    for name, run in runs.items():
        (tmp_path / name).mkdir()
        files.append(tmp_path / name / "sparse.json")
        files[-1].write_text(json.dumps(run))
    main(["--combine", *map(str, files), "--output", str(tmp_path / "all")])
    table = capsys.readouterr().out
    rows = [line.split(" | ")[:2] for line in table.splitlines() if line.startswith("| ") and "policy" not in line]
    assert rows == [["| full", "4096"], ["| full", "8192"], ["| quest", "4096"], ["| quest", "8192"],
                    ["| quest [quest_token_budget=8192]", "4096"]]  # a variant of a policy: a row of its own
    assert "| quest | 4096 | 75.00 (2/2) | -25.00 |" in table and "| quest | 8192 | 25.00 (1/2) | -50.00 |" in table
    assert "- quest: vt 8192 -100.0, cwe 4096 -50.0, cwe 8192 +0.0" in table
    assert (tmp_path / "all" / "sparse.md").read_text() == table
    with pytest.raises(ValueError, match="quest at length 4096 is in two of the runs"):
        main(["--combine", str(files[3]), str(files[3])])


def test_a_run_is_named_by_its_policys_options_apart_from_the_defaults():
    from nanovllm.eval.ruler.sparse import run_name

    options = {"quest_token_budget": 8192, "quest_rerank": 2, "xattn_threshold": 0.8, "num_gpu_blocks": 16}
    assert run_name("full", options) == "full"
    assert run_name("quest", options) == "quest [quest_token_budget=8192]"  # rerank 2 is the default
    assert run_name("xattention", options) == "xattention [xattn_threshold=0.8]"
    assert run_name("xattention+quest", options) == "xattention+quest [quest_token_budget=8192, xattn_threshold=0.8]"
    assert run_name("quest", {"num_gpu_blocks": 16}) == "quest"


def test_options_the_comparison_does_not_take_are_refused(tmp_path, capsys):
    for extra in (["--hf-check"], ["--sparse-policy", "quest"]):
        with pytest.raises(SystemExit):
            main(["--lengths", "1024", "--tasks", "vt", "--samples", "1", "--output", str(tmp_path), *extra])
        assert "is not taken by the sparse comparison" in capsys.readouterr().err


@pytest.mark.slow
def test_policies_run_on_the_same_samples(tmp_path, smollm2_path):
    from nanovllm.eval.ruler.run import main as ruler_main

    samples = tmp_path / "samples.json.gz"
    ruler_main(["--model", str(smollm2_path), "--lengths", "1024", "--tasks", "niah_single_1", "--samples", "2",
                "--generator", "ours", "--save-samples", str(samples)])
    main(["--model", str(smollm2_path), "--samples-file", str(samples), "--lengths", "1024", "--tasks", "niah_single_1",
          "--samples", "2", "--policies", "full", "xattention+quest", "--device", "cpu", "--dtype", "float32",
          "--kvcache-block-size", "16", "--sparse-min-context", "0", "--xattn-block-size", "16",
          "--quest-token-budget", "64", "--quest-dense-layers", "0", "--output", str(tmp_path / "out"), "--no-progress"])
    saved = json.loads((tmp_path / "out" / "sparse.json").read_text())
    name = "xattention+quest [quest_dense_layers=0, quest_token_budget=64, xattn_block_size=16]"
    assert set(saved) == {"full", name}
    full, sparse = saved["full"]["attention"]["1024"], saved[name]["attention"]["1024"]
    assert full["prefill_density"] == full["decode_density"] == 1.0
    assert sparse["prefill_density"] < 1.0 and sparse["decode_density"] < 1.0
    assert (tmp_path / "out" / "xattention_quest" / "ruler.json").exists()
    assert f"| {name} | 1024 |" in (tmp_path / "out" / "sparse.md").read_text()
