"""Run RULER over the engine (`run_ruler`) and the `nanovllm ruler` command (`main`, `add_ruler_parser`)."""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

from nanovllm.engine_args import add_engine_options, engine_options, run_command
from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.report import markdown_table, save_chart
from nanovllm.eval.ruler.scoring import passed, sample_score, summarize
from nanovllm.eval.ruler.tasks import DEFAULT_SEED, TASK_NAMES, TASKS, generate_samples, resolve_tasks
from nanovllm.eval.ruler.templates import TEMPLATE_KINDS, Prompter

GENERATORS = ("official", "ours")
DEFAULT_GENERATOR = "official"  # docs/RULER_PARITY.md: why not ours


def run_ruler(llm, lengths, tasks="all", num_samples: int = 10, output_dir: str | Path = "ruler_results",
              template: str = "chat", use_tqdm: bool = True, seed: int = DEFAULT_SEED,
              samples_file: str | Path | None = None, hf_check: bool = False,
              generator: str = DEFAULT_GENERATOR, hf_batch_size: int = 32) -> dict:
    """Generate RULER samples, run them all through ``llm.generate`` as one batch, score and report.

    Greedy decoding, per-task max_tokens, prompts passed as token ids (tokenized without special
    tokens, so the budget is exactly what was measured). Writes ``ruler.json`` (every prompt,
    prediction, references and score), ``ruler.md`` and ``ruler.png`` to ``output_dir`` and prints
    the table. Returns {"summary", "records", "timings", "files"}.
    samples_file: read pre-generated samples (see save_samples) instead of generating them.
    hf_check: also run the prompts through HF transformers and score those predictions the same way.
    hf_batch_size: prompts per HF generate call (left-padded); 1 runs each prompt alone, in one pass.
    generator: "official" (NVIDIA's scripts, see official.py) or "ours" (tasks.py).
    """
    from nanovllm.sampling_params import SamplingParams

    lengths = [int(n) for n in lengths]
    names = resolve_tasks(tasks)
    if llm.tokenizer is None:
        raise ValueError("RULER needs the model's tokenizer")
    limit = llm.config.max_model_len
    if max(lengths) > limit:
        raise ValueError(f"length {max(lengths)} exceeds the engine's max_model_len={limit}")
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    if samples_file:
        samples = samples_from_file(samples_file, names, lengths, num_samples)
    else:
        samples = make_samples(generator, llm.tokenizer, llm.config.model_path, lengths, names, num_samples,
                               template, seed)
    prompter = Prompter(llm.tokenizer, template)
    token_ids = [prompter.encode(s["prompt"]) for s in samples]
    over = []
    for s, ids in zip(samples, token_ids):
        assert len(ids) == s["prompt_tokens"], s["task"]
        if len(ids) + s["max_new_tokens"] > s["length"]:
            over.append(f"{s['task']}@{s['length']}#{s['index']}")
    if over:  # RULER's fwe script sizes its text against the whole length, leaving no room to generate
        _log(f"{len(over)} prompts leave fewer than max_new_tokens before their length: {', '.join(over)}")
    params = [SamplingParams(temperature=0.0, max_tokens=s["max_new_tokens"]) for s in samples]
    generated = time.perf_counter()
    _log(f"{len(samples)} samples ({len(names)} tasks x {len(lengths)} lengths x {num_samples}) generated in "
         f"{generated - started:.1f} s; running them through the engine")

    outputs = llm.generate(token_ids, params, use_tqdm=use_tqdm)
    finished = time.perf_counter()

    records = []
    for s, out in zip(samples, outputs):
        score = sample_score(TASKS[s["task"]].metric, out.text, s["references"])
        records.append({**s, "prediction": out.text, "output_tokens": len(out.token_ids),
                        "finish_reason": out.finish_reason, "score": score, "passed": passed(score),
                        "prefill_density": out.metrics.prefill_density, "decode_density": out.metrics.decode_density,
                        "host_kv_bytes_read": out.metrics.host_kv_bytes_read})
    summary = summarize(records)
    engine_s = finished - generated
    hf = _hf_check(llm, samples, token_ids, records, use_tqdm, hf_batch_size) if hf_check else None
    prompt_tokens = sum(len(ids) for ids in token_ids)
    output_tokens = sum(r["output_tokens"] for r in records)
    timings = {
        "generate_samples_s": round(generated - started, 3),
        "engine_s": round(engine_s, 3),
        "samples_per_s": round(len(records) / engine_s, 4) if engine_s > 0 else None,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "tokens_per_s": round((prompt_tokens + output_tokens) / engine_s, 1) if engine_s > 0 else None,
    }
    work = attention_work(records, lengths)
    table = markdown_table(summary)
    model = str(getattr(llm.config, "model", ""))
    config = {"model": model, "lengths": lengths, "tasks": names, "num_samples": num_samples,
              "template": template, "seed": seed, "max_model_len": limit,
              "generator": generator if not samples_file else (samples[0].get("generator") if samples else None),
              "data_packages": [p.requirement for p in data.PACKAGES.values()]}
    files = {"json": out_dir / "ruler.json", "markdown": out_dir / "ruler.md"}
    files["json"].write_text(json.dumps({"config": config, "summary": summary, "timings": timings, "hf_check": hf,
                                         "attention": work, "samples": records}, indent=1, ensure_ascii=False) + "\n")
    speed = (f"{len(records)} samples in {engine_s:.1f} s: {timings['samples_per_s']} samples/s, "
             f"{timings['tokens_per_s']} tokens/s ({prompt_tokens} prompt + {output_tokens} output tokens)")
    hf_text = "" if hf is None else (f"\n\nHF transformers on the same prompts ({hf['identical_predictions']}/"
                                     f"{hf['samples']} predictions identical):\n\n{markdown_table(hf['summary'])}")
    files["markdown"].write_text(f"# RULER: {Path(model).name or model}\n\n{table}\n\n{speed}\n\n"
                                 f"{attention_text(work)}{hf_text}\n")
    chart = save_chart(summary, out_dir / "ruler.png", title=f"RULER: {Path(model).name or model} ({template})")
    if chart is not None:
        files["chart"] = chart
    print(f"\nRULER on {model} ({template} template)\n\n{table}\n\n{speed}\n{attention_text(work)}\nresults: {out_dir}")
    return {"summary": summary, "records": records, "timings": timings, "hf_check": hf, "attention": work,
            "files": {k: str(v) for k, v in files.items()}}


def attention_work(records: list[dict], lengths: list[int]) -> dict[str, dict[str, float]]:
    """Per length: the mean prefill and decode attention density of its samples (1.0 when dense) and the
    host KV bytes they read (offload mode)."""
    work = {}
    for length in lengths:
        rows = [r for r in records if r["length"] == length]
        if rows:
            work[str(length)] = {
                "prefill_density": round(sum(r["prefill_density"] for r in rows) / len(rows), 4),
                "decode_density": round(sum(r["decode_density"] for r in rows) / len(rows), 4),
                "host_kv_gb": round(sum(r["host_kv_bytes_read"] for r in rows) / 1e9, 3)}
    return work


def attention_text(work: dict[str, dict[str, float]]) -> str:
    return "Attention work: " + "; ".join(
        f"{length}: prefill density {w['prefill_density']:.3f}, decode density {w['decode_density']:.3f}, "
        f"host KV read {w['host_kv_gb']:.2f} GB" for length, w in work.items())


def make_samples(generator: str, tokenizer, model_path: str, lengths, tasks, num_samples: int, template: str,
                 seed: int) -> list[dict]:
    """Samples from NVIDIA's scripts ("official") or from our generator ("ours"), in the same format."""
    if generator == "official":
        from nanovllm.eval.ruler.official import generate_official_samples

        return generate_official_samples(tokenizer, model_path, lengths, tasks, num_samples, template, seed)
    if generator != "ours":
        raise ValueError(f"generator must be one of {GENERATORS}, got {generator!r}")
    data.ensure_ruler_data()
    return generate_samples(tokenizer, lengths, tasks, num_samples, template, seed)


def save_samples(samples: list[dict], path: str | Path) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(samples, f, ensure_ascii=False)


def first_samples(samples: list[dict], names: list[str], lengths: list[int], per_cell: int) -> list[dict]:
    """The first per_cell samples of each (task, length) among names x lengths, in file order."""
    kept: list[dict] = []
    counts: dict[tuple[str, int], int] = {}
    for s in samples:
        cell = (s["task"], s["length"])
        if s["task"] in names and s["length"] in lengths and counts.get(cell, 0) < per_cell:
            counts[cell] = counts.get(cell, 0) + 1
            kept.append(s)
    return kept


def load_samples(path: str | Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def samples_from_file(path: str | Path, names: list[str], lengths: list[int], per_cell: int) -> list[dict]:
    """first_samples of a --save-samples file; ValueError naming the lengths and tasks the file holds if none
    matches (a run of 0 samples would print a 0.00 average)."""
    samples = load_samples(path)
    kept = first_samples(samples, names, lengths, per_cell)
    held_lengths = sorted({s["length"] for s in samples})
    held_tasks = [t for t in TASK_NAMES if any(s["task"] == t for s in samples)]
    if not kept:
        raise ValueError(f"no sample in {path} matches --lengths {' '.join(map(str, lengths))} and --tasks "
                         f"{' '.join(names)}; the file holds lengths {' '.join(map(str, held_lengths)) or 'none'} "
                         f"and tasks {' '.join(held_tasks) or 'none'}")
    missing = [str(n) for n in lengths if n not in held_lengths] + [t for t in names if t not in held_tasks]
    if missing:
        _log(f"{path} holds no samples for {', '.join(missing)}; running the {len(kept)} that match")
    return kept


def _hf_check(llm, samples: list[dict], token_ids: list[list[int]], records: list[dict], use_tqdm: bool,
              batch_size: int) -> dict:
    """Score HF transformers' greedy predictions on the same prompts; per task and length, both scores."""
    from nanovllm.eval.ruler.hf_check import hf_predictions

    predictions = hf_predictions(llm.config.model_path, token_ids, [s["max_new_tokens"] for s in samples],
                                 batch_size=batch_size, use_tqdm=use_tqdm)
    hf_records = []
    for s, rec, pred in zip(samples, records, predictions):
        score = sample_score(TASKS[s["task"]].metric, pred, s["references"])
        rec.update(hf_prediction=pred, hf_score=score, same_prediction=pred.strip() == rec["prediction"].strip())
        hf_records.append({**s, "prediction": pred, "score": score, "passed": passed(score)})
    hf_summary = summarize(hf_records)
    same = sum(r["same_prediction"] for r in records)
    _log(f"HF transformers cross-check: {same}/{len(records)} predictions identical\n{markdown_table(hf_summary)}")
    return {"summary": hf_summary, "identical_predictions": same, "samples": len(records)}


def _log(msg: str) -> None:
    print(f"[nanovllm.ruler] {msg}", file=sys.stderr, flush=True)


# ---- command line ------------------------------------------------------------------------------

def parse_length(text: str) -> int:
    """4096, 4k or 4K (x1024)."""
    t = text.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length: {text!r}") from None


def add_ruler_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", type=parse_length, nargs="+", default=[4096],
                        help="sequence lengths in tokens (prompt + max new tokens), e.g. 4096 8k (default: 4096)")
    parser.add_argument("--tasks", nargs="+", default=["all"], metavar="TASK",
                        help=f"'all' or task names: {', '.join(TASK_NAMES)}")
    parser.add_argument("--samples", type=int, default=10, help="samples per task and length (default: 10); with --samples-file, the first N of each")
    parser.add_argument("--output", default="ruler_results", help="output directory (default: ruler_results)")
    parser.add_argument("--template", choices=TEMPLATE_KINDS, default="chat",
                        help="chat: the model's chat template + answer prefix; base: bare task text + answer prefix")
    parser.add_argument("--data-seed", type=int, default=DEFAULT_SEED, help="seed of the sample generator (42)")
    parser.add_argument("--generator", choices=GENERATORS, default=DEFAULT_GENERATOR,
                        help="official: NVIDIA's own RULER scripts from nvidia-long-context-eval (cached); "
                             "ours: our faster re-implementation (see docs/RULER_PARITY.md)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--save-samples", default=None, metavar="FILE",
                        help="generate the samples, write them to FILE (gzip JSON) and stop; no model is run")
    parser.add_argument("--samples-file", default=None, metavar="FILE",
                        help="run samples written by --save-samples instead of generating them")
    parser.add_argument("--hf-check", action="store_true",
                        help="also run the same prompts through HF transformers (greedy) and report both scores")
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="prompts per HF generate call with --hf-check (default: 32; 1: each prompt alone, unpadded)")
    add_engine_options(parser)


def cmd_ruler(args: argparse.Namespace) -> dict:
    from nanovllm import LLM

    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    tasks = resolve_tasks(args.tasks)
    options = engine_options(args)
    options.setdefault("max_model_len", max(args.lengths))
    if args.save_samples:
        from transformers import AutoTokenizer

        from nanovllm.models.fetch import default_model_path

        model_path = str(args.model or default_model_path())
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        samples = make_samples(args.generator, tokenizer, model_path, args.lengths, tasks, args.samples,
                               args.template, args.data_seed)
        save_samples(samples, args.save_samples)
        _log(f"{len(samples)} samples written to {args.save_samples}")
        return {"samples": len(samples)}
    if args.samples_file:
        samples_from_file(args.samples_file, tasks, args.lengths, args.samples)  # refuse a mismatch before loading
    else:
        data.ensure_ruler_data()  # install and verify the data before loading the model
    llm = LLM(args.model, **options)
    return run_ruler(llm, args.lengths, tasks, args.samples, args.output, args.template,
                     use_tqdm=not args.no_progress, seed=args.data_seed, samples_file=args.samples_file,
                     hf_check=args.hf_check, generator=args.generator, hf_batch_size=args.hf_batch_size)


def add_ruler_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `ruler` command to a `nanovllm` subparsers object; its func is cmd_ruler."""
    parser = subparsers.add_parser("ruler", help="run the RULER long-context benchmark",
                                   description="Run the RULER long-context benchmark over the engine.")
    add_ruler_arguments(parser)
    parser.set_defaults(func=cmd_ruler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm ruler", description="Run the RULER long-context benchmark.")
    add_ruler_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`nanovllm ruler ...` without the word `ruler`: main(["--lengths", "4096", "--samples", "5"])."""
    run_command(cmd_ruler, build_parser().parse_args(argv))
