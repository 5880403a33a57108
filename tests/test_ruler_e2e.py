"""RULER end to end on SmolLM2-135M on the CPU: 2 samples of 3 tasks at 4K through the real engine."""
from __future__ import annotations

import json

import pytest

TASKS = ["niah_single_1", "vt", "qa_1"]


@pytest.mark.slow
def test_ruler_end_to_end_smollm2(tmp_path):
    from nanovllm import LLM
    from nanovllm.eval.ruler import run_ruler
    from nanovllm.models.fetch import fetch_model

    llm = LLM(str(fetch_model("smollm2-135m", progress=False)), max_model_len=4096 + 256, device="cpu")
    result = run_ruler(llm, [4096], TASKS, 2, tmp_path, template="chat", use_tqdm=False, generator="ours")

    records = result["records"]
    assert [r["task"] for r in records] == [t for t in TASKS for _ in range(2)]
    for r in records:
        assert isinstance(r["prediction"], str) and 0 < r["output_tokens"] <= r["max_new_tokens"]
        assert r["prompt_tokens"] + r["max_new_tokens"] <= 4096
        assert 0.0 <= r["score"] <= 100.0 and r["finish_reason"] in ("stop", "length")
    summary = result["summary"]
    assert set(summary["tasks"]) == set(TASKS) and summary["lengths"][4096]["total"] == 6
    # the engine must be sane: the easiest task (one needle in repeated noise) is solved by SmolLM2
    assert summary["tasks"]["niah_single_1"][4096]["passed"] >= 1
    saved = json.loads((tmp_path / "ruler.json").read_text())
    assert len(saved["samples"]) == 6 and saved["timings"]["samples_per_s"] > 0
    assert (tmp_path / "ruler.md").exists()


@pytest.mark.slow
def test_saved_samples_and_hf_cross_check(tmp_path, smollm2_path):
    """Samples written by --save-samples run unchanged; HF transformers scores the same prompts."""
    from nanovllm import LLM
    from nanovllm.eval.ruler.run import main, run_ruler

    samples_file = tmp_path / "samples.json.gz"
    main(["--model", str(smollm2_path), "--lengths", "1024", "--tasks", "niah_single_1", "vt", "--samples", "1",
          "--generator", "ours", "--save-samples", str(samples_file)])
    llm = LLM(str(smollm2_path), device="cpu", max_model_len=1024, kvcache_block_size=16)
    result = run_ruler(llm, [1024], ["niah_single_1", "vt"], 1, tmp_path / "out", samples_file=samples_file,
                       hf_check=True, use_tqdm=False)
    hf = result["hf_check"]
    assert hf["samples"] == 2 and set(hf["summary"]["tasks"]) == {"niah_single_1", "vt"}
    # float32 on both sides: greedy predictions should agree exactly
    assert hf["identical_predictions"] == 2, [(r["prediction"], r["hf_prediction"]) for r in result["records"]]
