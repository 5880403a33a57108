"""Sample by sample: which RULER samples each run passes that a reference run fails, and the other way.

    python -m nanovllm.eval.ruler.flips REF/ruler.json A/ruler.json B/ruler.json --names unchunked 8K 4K

A setting that only adds bf16 noise flips about as many samples one way as the other; a precision loss
flips them one way. The reference file's HF cross-check (`--hf-check`) counts as one more run, "HF".
`--compact DIR` also writes each run's per-sample results without the prompts (small enough to keep).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

MAX_PASS_DIFFERENCE = 2  # issue #14: every mode's pass count within 2 of the unchunked run
DRIFT_MIN_FLIPS, DRIFT_RATIO = 6, 2  # with 6 or more flips, at most twice as many one way as the other

Key = tuple[str, int, int]


@dataclass
class Run:
    name: str
    samples: dict[Key, dict]  # (task, length, index) -> {"passed", "score", "prediction"}

    @property
    def passed(self) -> int:
        return sum(s["passed"] for s in self.samples.values())

    @property
    def average(self) -> float:
        """The mean over (task, length) cells of the cell's mean score, as the RULER report averages."""
        cells: dict[tuple[str, int], list[float]] = {}
        for (task, length, _), s in self.samples.items():
            cells.setdefault((task, length), []).append(s["score"])
        return statistics.mean(statistics.mean(v) for v in cells.values())


@dataclass
class Flips:
    name: str
    passed: int
    average: float
    lost: int  # reference passes, this run fails
    gained: int  # reference fails, this run passes
    identical: int  # same prediction text
    common: int

    def meets_targets(self, reference_passed: int) -> bool:
        one_way = max(self.lost, self.gained) <= DRIFT_RATIO * min(self.lost, self.gained)
        drift_ok = self.lost + self.gained < DRIFT_MIN_FLIPS or one_way
        return abs(self.passed - reference_passed) <= MAX_PASS_DIFFERENCE and drift_ok


def load_records(path: str | Path) -> list[dict]:
    """The samples of a ruler.json, or of a compact file (a list of samples, as --compact writes)."""
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return data if isinstance(data, list) else data["samples"]


def load_run(path: str | Path, name: str) -> Run:
    return run_from_records(load_records(path), name)


def run_from_records(records: list[dict], name: str) -> Run:
    return Run(name, {(r["task"], int(r["length"]), int(r["index"])): {
        "passed": bool(r["passed"]), "score": float(r["score"]), "prediction": r["prediction"]} for r in records})


def hf_run(records: list[dict]) -> Run | None:
    """The HF predictions a --hf-check run stored beside its own, as a run; None without them."""
    if not records or "hf_prediction" not in records[0]:
        return None
    from nanovllm.eval.ruler.scoring import passed

    return run_from_records([{**r, "prediction": r["hf_prediction"], "score": r["hf_score"],
                              "passed": passed(r["hf_score"])} for r in records], "HF")


def flips(reference: Run, run: Run) -> Flips:
    common = [k for k in reference.samples if k in run.samples]
    if not common:
        raise ValueError(f"{run.name} shares no sample with {reference.name}")
    ref, got = reference.samples, run.samples
    return Flips(run.name, run.passed, run.average,
                 lost=sum(ref[k]["passed"] and not got[k]["passed"] for k in common),
                 gained=sum(got[k]["passed"] and not ref[k]["passed"] for k in common),
                 identical=sum(ref[k]["prediction"].strip() == got[k]["prediction"].strip() for k in common),
                 common=len(common))


def flip_table(reference: Run, runs: list[Run]) -> str:
    """Markdown: per run its pass count and average, the samples it loses and gains against the
    reference, identical predictions, and whether it meets issue #14's targets."""
    lines = [f"| run | passed | average | vs {reference.name}: pass -> fail | fail -> pass | identical predictions "
             f"| within {MAX_PASS_DIFFERENCE}, no one-way drift |", "|---|---|---|---|---|---|---|",
             f"| {reference.name} (reference) | {reference.passed} | {reference.average:.2f} | | | | |"]
    for run in runs:
        f = flips(reference, run)
        lines.append(f"| {f.name} | {f.passed} | {f.average:.2f} | {f.lost} | {f.gained} | {f.identical}/{f.common} | "
                     f"{'yes' if f.meets_targets(reference.passed) else 'no'} |")
    return "\n".join(lines)


def compact(path: str | Path) -> list[dict]:
    """A run's per-sample results without the prompts."""
    return [{k: v for k, v in r.items() if k != "prompt"} for r in load_records(path)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reference", type=Path, metavar="REFERENCE_JSON")
    parser.add_argument("runs", nargs="*", type=Path, metavar="RULER_JSON")
    parser.add_argument("--names", nargs="+", default=None, help="names of the reference and of each run")
    parser.add_argument("--compact", type=Path, default=None, metavar="DIR",
                        help="also write each run's samples without prompts to DIR/<name>.json")
    args = parser.parse_args(argv)
    paths = [args.reference, *args.runs]
    names = args.names or [p.parent.name or p.stem for p in paths]
    if len(names) != len(paths):
        raise SystemExit(f"--names: {len(paths)} names needed, got {len(names)}")
    records = load_records(args.reference)
    reference = run_from_records(records, names[0])
    runs = [load_run(p, n) for p, n in zip(args.runs, names[1:])]
    hf = hf_run(records)
    print(flip_table(reference, runs + ([hf] if hf else [])))
    if args.compact:
        args.compact.mkdir(parents=True, exist_ok=True)
        for p, n in zip(paths, names):
            (args.compact / f"{n}.json").write_text(json.dumps(compact(p), ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
