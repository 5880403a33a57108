"""lm-evaluation-harness, a client none of us wrote, against `nanovllm serve` (`--model local-completions`: token-id
prompts in batches, echo + logprobs for loglikelihoods, stop strings for generate_until, the API key) and against HF
transformers (`--model hf`) on the same SmolLM2 weights in fp32: the same scores, per-document loglikelihoods within
float noise and the same generated text. Tasks: tests/data/lm_eval (a multiple-choice task and a generate_until task,
a handful of documents each)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "data" / "lm_eval"
TASKS = ("nanovllm_mc", "nanovllm_gen")
METRICS = {"nanovllm_mc": ("acc,none", "acc_norm,none"), "nanovllm_gen": ("exact_match,none",)}
KEY = "lm-eval-key"


def lm_eval(model: str, model_args: str, out: Path, batch_size: int, env: dict[str, str]) -> tuple[dict, dict]:
    """Run the lm_eval command line; its results and its samples per task (doc_id -> filtered responses)."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", str(TASK_DIR), "--batch_size", str(batch_size), "--device", "cpu",
           "--output_path", str(out), "--log_samples", "--seed", "1234"]
    run_env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_DATASETS_CACHE": str(out / "datasets"), **env}
    done = subprocess.run(cmd, cwd=TASK_DIR, env=run_env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in TASKS:
        lines = next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
        samples[task] = {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, lines)}
    return results, samples


def test_lm_eval_against_the_server_equals_hf(smollm2_path, tmp_path):
    server = ServerProcess(smollm2_path, ["--num-gpu-blocks", "64"], tmp_path / "server.log",
                           env={"NANOVLLM_API_KEY": KEY})
    try:
        args = f"model=smollm2,base_url={server.url}/v1/completions,tokenizer={smollm2_path}," \
               "tokenizer_backend=huggingface,max_retries=1,timeout=120"
        ours, our_samples = lm_eval("local-completions", args, tmp_path / "ours", 4, {"OPENAI_API_KEY": KEY})
    finally:
        server.stop()
    assert "Traceback" not in server.log_path.read_text()
    hf, hf_samples = lm_eval("hf", f"pretrained={smollm2_path},dtype=float32", tmp_path / "hf", 1, {})
    print({task: {m: (ours[task][m], hf[task][m]) for m in METRICS[task]} for task in TASKS})
    for task in TASKS:
        for metric in METRICS[task]:
            assert ours[task][metric] == hf[task][metric], (task, metric, ours[task], hf[task])
    assert 0 < hf["nanovllm_mc"]["acc,none"] and 0 < hf["nanovllm_gen"]["exact_match,none"]  # not a vacuous match
    assert our_samples["nanovllm_gen"] == hf_samples["nanovllm_gen"]
    for doc_id, choices in hf_samples["nanovllm_mc"].items():
        for (ll_hf, greedy_hf), (ll_ours, greedy_ours) in zip(choices, our_samples["nanovllm_mc"][doc_id]):
            assert float(ll_ours) == pytest.approx(float(ll_hf), abs=1e-3) and greedy_ours == greedy_hf
