"""Block-sparse attention's accuracy on RULER: the same samples through dense attention ("full") and each
sparse policy, one table (issue #15): per length each policy's average, passed samples and difference
from full, its mean prefill and decode density and the host KV it read, then the tasks where each policy
loses most against full.

    python -m nanovllm.eval.ruler.sparse --model DIR --samples-file F --lengths 16384 32768 \\
        --tasks niah_single_1 niah_multikey_1 ... [--policies full xattention quest xattention+quest] \\
        [--output DIR] [any engine option: --enable-cpu-offload --num-gpu-blocks 16 --sparse-min-context 0 ...]

Each policy runs in turn in this process (`run_ruler`, one engine at a time); its own RULER report goes
to OUTPUT/<policy>/, the table to OUTPUT/sparse.md and OUTPUT/sparse.json. Runs made apart (a process per
policy or length, as bench/device/sparse_table.sh runs them) make one table again:

    python -m nanovllm.eval.ruler.sparse --combine RUN/sparse.json ... [--output DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path

from nanovllm.config import EngineConfig
from nanovllm.engine_args import engine_options, run_command
from nanovllm.eval.ruler.run import add_ruler_arguments, run_ruler, samples_from_file
from nanovllm.eval.ruler.tasks import resolve_tasks

POLICIES = ("full", "xattention", "quest", "xattention+quest")


def sparse_table(results: dict[str, dict], reference: str = "full", worst: int = 3) -> str:
    """Markdown from {policy: run_ruler result}: per length and policy the average (passed/total), the
    difference from the reference policy, densities and host KV; then per policy its `worst` task cells
    against the reference."""
    lines = ["| policy | length | average (passed) | vs full | prefill density | decode density | host KV read |",
             "|---|---|---|---|---|---|---|"]
    base = results.get(reference)
    for policy, result in results.items():
        for length, cell in result["summary"]["lengths"].items():
            work = result["attention"].get(str(length), {})
            delta = "" if base is None or policy == reference else \
                f"{cell['score'] - base['summary']['lengths'][length]['score']:+.2f}"
            lines.append(f"| {policy} | {length} | {cell['score']:.2f} ({cell['passed']}/{cell['total']}) | {delta} | "
                         f"{work.get('prefill_density', 1.0):.3f} | {work.get('decode_density', 1.0):.3f} | "
                         f"{work.get('host_kv_gb', 0.0):.2f} GB |")
    if base is not None:
        lines += ["", "Largest per-task losses against full:", ""]
        for policy, result in results.items():
            if policy == reference:
                continue
            drops = [(cell["score"] - base["summary"]["tasks"][task][length]["score"], task, length)
                     for task, by_length in result["summary"]["tasks"].items() for length, cell in by_length.items()]
            drops.sort()
            lines.append(f"- {policy}: " + ", ".join(f"{task} {length} {d:+.1f}" for d, task, length in drops[:worst]))
    return "\n".join(lines)


def run_name(policy: str, options: dict) -> str:
    """A table row's name: the policy, and its own options given apart from the engine's defaults (xattn_* for
    XAttention, quest_* for Quest), so that runs of one policy with other options are rows of their own."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    prefixes = tuple(prefix for name, prefix in (("xattention", "xattn_"), ("quest", "quest_")) if name in policy)
    changed = [f"{k}={v}" for k, v in sorted(options.items()) if prefixes and k.startswith(prefixes)
               and v != defaults.get(k)]
    return policy + (f" [{', '.join(changed)}]" if changed else "")


def merge_results(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """One {policy: result} from several (sparse.json files of runs made apart, each of some policies and
    lengths): per policy its lengths' summaries, task cells and attention figures together, "full" first;
    the overall score is left out (it would mix lengths of other runs). A (policy, length) given twice is
    refused."""
    merged: dict[str, dict] = {}
    for part in parts:
        for policy, result in part.items():
            into = merged.setdefault(policy, {"summary": {"tasks": {}, "lengths": {}}, "attention": {}})
            for length, cell in result["summary"]["lengths"].items():
                if length in into["summary"]["lengths"]:
                    raise ValueError(f"{policy} at length {length} is in two of the runs")
                into["summary"]["lengths"][length] = cell
                into["attention"][length] = result["attention"].get(length, {})
            for task, by_length in result["summary"]["tasks"].items():
                into["summary"]["tasks"].setdefault(task, {}).update(by_length)
    by_length = lambda cells: dict(sorted(cells.items(), key=lambda item: int(item[0])))  # noqa: E731
    for result in merged.values():  # lengths in order, whichever run brought them
        result["attention"] = by_length(result["attention"])
        result["summary"]["lengths"] = by_length(result["summary"]["lengths"])
    return dict(sorted(merged.items(), key=lambda item: (POLICIES.index(item[0].split(" [")[0]), item[0])))


def combine(files: list[str], output: str | None) -> str:
    """The table of runs made apart (merge_results), printed and, with output, written there as sparse.md
    and sparse.json."""
    results = merge_results([json.loads(Path(f).read_text()) for f in files])
    table = sparse_table(results)
    if output:
        out = Path(output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sparse.md").write_text(table + "\n")
        (out / "sparse.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(table)
    return table


def run_policies(args: argparse.Namespace) -> dict[str, dict]:
    from nanovllm import LLM

    for flag, given in (("--hf-check", args.hf_check), ("--save-samples", args.save_samples),
                        ("--sparse-policy (use --policies)", args.sparse_policy)):
        if given:
            raise ValueError(f"{flag} is not taken by the sparse comparison")
    tasks = resolve_tasks(args.tasks)
    if args.samples_file:
        samples_from_file(args.samples_file, tasks, args.lengths, args.samples)  # refuse a mismatch first
    out = Path(args.output)
    results = {}
    for policy in args.policies:
        options = {**engine_options(args), "sparse_policy": policy}
        options.setdefault("max_model_len", max(args.lengths))
        llm = LLM(args.model, **options)
        result = run_ruler(llm, args.lengths, tasks, args.samples, out / policy.replace("+", "_"), args.template,
                           use_tqdm=not args.no_progress, seed=args.data_seed, samples_file=args.samples_file,
                           generator=args.generator)
        results[run_name(policy, options)] = {k: result[k] for k in ("summary", "attention", "timings")}
        llm.shutdown()
        del llm
        gc.collect()
        _empty_device_cache()
    table = sparse_table(results)
    (out / "sparse.md").write_text(table + "\n")
    (out / "sparse.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"\n{table}")
    return results


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.eval.ruler.sparse", description=__doc__.split("\n")[0])
    add_ruler_arguments(parser)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                        help="sparse policies to run, full first for the differences (default: all four)")
    parser.set_defaults(output="ruler_sparse")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--combine"]:
        parser = argparse.ArgumentParser(prog="python -m nanovllm.eval.ruler.sparse --combine",
                                         description="one table from the sparse.json files of runs made apart")
        parser.add_argument("files", nargs="+")
        parser.add_argument("--output", help="a directory for the combined sparse.md and sparse.json")
        args = parser.parse_args(argv[1:])
        combine(args.files, args.output)
        return
    run_command(run_policies, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
