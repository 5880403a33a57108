"""Needle in a haystack: a sweep over context lengths x needle depths, with a heatmap.

    from nanovllm.eval.needle import run_needle
    run_needle(llm, lengths=[1024, 4096], depths=[0, 25, 50, 75, 100], output_dir="needle_out")

Every prompt is RULER's niah_single task (``niah_single_2`` with ``haystack="essay"``, ``niah_single_1``
with ``haystack="noise"``): one needle ``One of the special magic numbers for {key} is: {value}.`` with a
word key (``adjective-noun``) and a 7-digit value, RULER's singular question and answer prefix, and the
chat (or base) wrapper of :class:`~nanovllm.eval.ruler.templates.Prompter`. What differs from RULER is
where the needle goes and how much haystack there is:

* depth: the needle goes at the haystack boundary (between essay sentences, or between noise lines)
  whose character offset is nearest to ``depth`` percent of the haystack, so 0 is the very start and
  100 the very end. The realised depth is recorded in characters and in tokens.
* size: the haystack is the largest number of units (essay words, or noise lines) for which
  ``len(prompt tokens) + MAX_NEW_TOKENS <= length``, found for each cell with the needle in place and
  counted with the model's tokenizer without special tokens; the prompt is sent as those token ids.
  Essay haystacks are the first N words of the Paul Graham essays (whole punkt sentences, the last one
  cut at the word limit), as in RULER; the slack left is under one unit (a word or a noise line).
* needles: sample ``i`` of every cell uses the same key and value (drawn from ``random.Random(seed)``),
  so cells differ only in length and depth.

MAX_NEW_TOKENS is 32, not RULER's 128: the answer prefix ends in "... mentioned in the provided text
is", so the value is the next thing written; a 7-digit number is at most ~10 tokens with punctuation
(one token a digit in SmolLM2/Llama/Qwen tokenizers). RULER's 128 is shared by all NIAH variants,
sized for 4 values or UUIDs. 32 keeps 3x headroom, gives 96 more haystack tokens to every prompt and
bounds the decode cost of models that ramble instead of answering.

All prompts go through one ``llm.generate`` call (greedy). Each prediction is scored with RULER's
string_match_all (100 if the value appears in the cleaned prediction, else 0). Writes ``needle.json``
(every prompt's length, depth, prediction, reference and score), ``needle.md`` and ``needle.png``.
"""
from __future__ import annotations

import argparse
import bisect
import functools
import json
import random
import sys
import time
import warnings
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from nanovllm.engine_args import add_engine_options, engine_options, run_command
from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.common import NOISE
from nanovllm.eval.ruler.niah import NEEDLE, random_item
from nanovllm.eval.ruler.scoring import clean_prediction, passed, string_match_all
from nanovllm.eval.ruler.tasks import DEFAULT_SEED
from nanovllm.eval.ruler.templates import TEMPLATE_KINDS, Prompter, niah_texts

MAX_NEW_TOKENS = 32
HAYSTACKS = ("essay", "noise")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = tuple(float(d) for d in range(0, 101, 10))  # 11 depths, percent
VALUE_TYPE = "numbers"  # RULER's niah_single_1/2: word keys, 7-digit number values
_SEPARATOR = {"essay": " ", "noise": "\n"}  # how haystack units (sentences, lines) are joined


@dataclass(frozen=True)
class Needle:
    key: str
    value: str

    @property
    def sentence(self) -> str:
        return NEEDLE.format(type=VALUE_TYPE, key=self.key, value=self.value)


def draw_needles(count: int, seed: int = DEFAULT_SEED) -> list[Needle]:
    """``count`` needles with distinct word keys and 7-digit values, from ``random.Random(seed)``."""
    rng = random.Random(seed)
    needles: list[Needle] = []
    while len(needles) < count:
        key = random_item(rng, "words")
        if all(n.key != key for n in needles):
            needles.append(Needle(key, random_item(rng, "numbers")))
    return needles


# ---- haystacks ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _essay() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The essays as punkt sentences, and the cumulative word counts before each sentence."""
    sentences = tuple(data.sent_tokenize(" ".join(data.essay_words()).strip()))
    return sentences, tuple(accumulate((len(s.split()) for s in sentences), initial=0))


def essay_sentences(words: int) -> list[str]:
    """The first ``words`` essay words as sentences (the last one cut at the limit); repeats past the end."""
    sentences, cum = _essay()
    repeats, rest = divmod(words, cum[-1])
    out = list(sentences) * repeats
    k = bisect.bisect_right(cum, rest) - 1  # whole sentences within `rest` words
    out += sentences[:k]
    if rest > cum[k]:
        out.append(" ".join(sentences[k].split()[:rest - cum[k]]))
    return out


def haystack_units(haystack: str, units: int) -> list[str]:
    """Haystack pieces: ``units`` essay words as sentences, or ``units`` noise lines."""
    if haystack == "essay":
        return essay_sentences(units)
    if haystack == "noise":
        return [NOISE] * units
    raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")


def insert_at_depth(pieces: list[str], sep: str, depth: float, needle: str) -> tuple[str, int, int]:
    """Insert ``needle`` as its own piece at the boundary nearest ``depth`` percent of the joined text.

    Boundary b sits after pieces[:b]; its offset is the length of ``sep.join(pieces[:b])``. Returns
    (context, offset of the needle's boundary in the haystack, haystack length in characters).
    """
    offsets = [0]
    for i, p in enumerate(pieces):
        offsets.append(offsets[-1] + len(p) + (len(sep) if i else 0))
    total = offsets[-1]
    target = total * depth / 100
    b = bisect.bisect_left(offsets, target)
    if b == len(offsets) or (b > 0 and target - offsets[b - 1] <= offsets[b] - target):
        b -= 1  # the nearer of the two boundaries around target (the earlier one on a tie)
    return sep.join(pieces[:b] + [needle] + pieces[b:]), offsets[b], total


# ---- prompts -----------------------------------------------------------------------------------

def render_prompt(prompter: Prompter, haystack: str, units: int, depth: float, needle: Needle) -> dict:
    """The full prompt of one cell for a haystack of ``units`` units (not yet sized to a length)."""
    context, before, total = insert_at_depth(haystack_units(haystack, units), _SEPARATOR[haystack], depth,
                                             needle.sentence)
    task_text, prefix = niah_texts(VALUE_TYPE, context, needle.key, 1)
    return {"prompt": prompter.build(task_text, prefix), "answer_prefix": prefix, "context": context,
            "needle_offset": before, "haystack_chars": total}


def _largest_fitting(fits, hint: int) -> int:
    """Largest n >= 0 with fits(n) (fits assumed monotone), galloping out from ``hint``, then bisecting."""
    hint = max(0, hint)
    if fits(hint):
        lo, step = hint, 1
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = hint, 1
        while True:
            lo = max(0, hi - step)
            if fits(lo):
                break
            if lo == 0:
                raise ValueError("no haystack fits")
            hi, step = lo, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _encode(tokenizer, rendered: dict, needle: Needle) -> tuple[list[int], float | None]:
    """Token ids of the prompt (no special tokens, as Prompter.encode) and the needle's depth in
    percent of the haystack's tokens (None for a tokenizer without offsets)."""
    prompt = rendered["prompt"]
    try:
        enc = tokenizer(prompt, add_special_tokens=False, verbose=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        return list(tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"]), None
    start = prompt.find(rendered["context"])
    end = start + len(rendered["context"])
    sep = 0 if rendered["needle_offset"] == 0 else 1
    n_start = start + rendered["needle_offset"] + sep
    n_end = n_start + len(needle.sentence)
    before = sum(1 for a, _ in offsets if start <= a < n_start)
    inside = sum(1 for a, _ in offsets if n_start <= a < n_end)
    hay = sum(1 for a, _ in offsets if start <= a < end) - inside
    return list(enc["input_ids"]), (round(100 * before / hay, 2) if hay else None)


def build_needle_prompts(tokenizer, lengths, depths, haystack: str = "essay", samples_per_cell: int = 1,
                         template: str = "chat", seed: int = DEFAULT_SEED) -> list[dict]:
    """One sized prompt per (length, depth, sample), in that nesting order (lengths outermost).

    Each dict has the prompt text and ``token_ids`` (what is sent), ``prompt_tokens``, ``units`` (essay
    words or noise lines), the key, the needle, ``reference`` (the value), ``depth`` (requested) and
    ``depth_chars`` / ``depth_tokens`` (realised, percent of the haystack before the needle).
    """
    lengths, depths = _check_grid(lengths, depths)
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    if samples_per_cell < 1:
        raise ValueError(f"samples_per_cell must be >= 1, got {samples_per_cell}")
    prompter = Prompter(tokenizer, template)
    needles = draw_needles(samples_per_cell, seed)
    out: list[dict] = []
    for length in lengths:
        budget = length - MAX_NEW_TOKENS
        hint = None
        for depth in depths:
            for index, needle in enumerate(needles):
                counts: dict[int, int] = {}
                best: dict = {}  # the largest fitting probe: units, rendered prompt, ids, token depth

                def fits(units: int, depth=depth, needle=needle, counts=counts, best=best) -> bool:
                    if units not in counts:
                        rendered = render_prompt(prompter, haystack, units, depth, needle)
                        ids, depth_tokens = _encode(tokenizer, rendered, needle)
                        counts[units] = len(ids)
                        if len(ids) <= budget and units > best.get("units", -1):
                            best.update(units=units, rendered=rendered, ids=ids, depth_tokens=depth_tokens)
                    return counts[units] <= budget

                if hint is None:
                    hint = _estimate_units(prompter, haystack, budget, needle, length)
                try:
                    units = _largest_fitting(fits, hint)
                except ValueError:
                    raise ValueError(f"length {length} is too short: the prompt without any haystack takes "
                                     f"{counts[0]} tokens, over the {budget}-token budget "
                                     f"({length} - {MAX_NEW_TOKENS} new tokens)") from None
                hint = units
                rendered, ids, depth_tokens = best["rendered"], best["ids"], best["depth_tokens"]
                assert best["units"] == units
                assert len(ids) + MAX_NEW_TOKENS <= length
                total = rendered["haystack_chars"]
                out.append({
                    "length": length, "depth": depth, "sample": index, "haystack": haystack,
                    "prompt": rendered["prompt"], "token_ids": ids, "prompt_tokens": len(ids),
                    "max_new_tokens": MAX_NEW_TOKENS, "units": units, "key": needle.key,
                    "needle": needle.sentence, "reference": needle.value, "answer_prefix": rendered["answer_prefix"],
                    "depth_chars": round(100 * rendered["needle_offset"] / total, 2) if total else depth,
                    "depth_tokens": depth_tokens, "template": template,
                })
    return out


def _estimate_units(prompter: Prompter, haystack: str, budget: int, needle: Needle, length: int) -> int:
    probe = 400 if haystack == "essay" else 20
    empty = prompter.count(render_prompt(prompter, haystack, 0, 50.0, needle)["prompt"])
    if empty > budget:
        raise ValueError(f"length {length} is too short: the prompt without any haystack takes {empty} tokens, "
                         f"over the {budget}-token budget ({length} - {MAX_NEW_TOKENS} new tokens)")
    full = prompter.count(render_prompt(prompter, haystack, probe, 50.0, needle)["prompt"])
    return int((budget - empty) * probe / max(1, full - empty))


def _check_grid(lengths, depths) -> tuple[list[int], list[float]]:
    lengths = [parse_length(n) if isinstance(n, str) else int(n) for n in lengths]
    depths = [float(d) for d in depths]
    if not lengths or not depths:
        raise ValueError("need at least one length and one depth")
    if min(lengths) < 1:
        raise ValueError(f"lengths must be positive, got {lengths}")
    bad = [d for d in depths if not 0.0 <= d <= 100.0]
    if bad:
        raise ValueError(f"depths are percentages in [0, 100], got {bad}")
    for name, values in (("lengths", lengths), ("depths", depths)):
        if len(set(values)) != len(values):
            raise ValueError(f"duplicate {name}: {values}")
    return lengths, depths


# ---- running, scoring, reporting ---------------------------------------------------------------

def run_needle(llm, lengths, depths, output_dir: str | Path = "needle_results", haystack: str = "essay",
               samples_per_cell: int = 1, template: str = "chat", seed: int = DEFAULT_SEED,
               use_tqdm: bool = True) -> dict:
    """Build every cell's prompts, run them all through one ``llm.generate`` call, score, report.

    ``lengths``: tokens (prompt + MAX_NEW_TOKENS), ints or "4k"; ``depths``: percent of the haystack.
    Returns {"config", "summary", "records", "timings", "files", "markdown"}; ``summary`` holds
    ``lengths``, ``depths``, ``scores`` (rows: depths, columns: lengths; mean 0-100 over the samples),
    ``length_means`` and ``overall``.
    """
    from nanovllm.sampling_params import SamplingParams

    lengths, depths = _check_grid(lengths, depths)
    if getattr(llm, "tokenizer", None) is None:
        raise ValueError("the needle test needs the model's tokenizer")
    config = getattr(llm, "config", None)
    limit = getattr(config, "max_model_len", None)
    if limit is not None and max(lengths) > limit:
        raise ValueError(f"length {max(lengths)} exceeds the engine's max_model_len={limit}")
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    samples = build_needle_prompts(llm.tokenizer, lengths, depths, haystack, samples_per_cell, template, seed)
    built = time.perf_counter()
    _log(f"{len(samples)} prompts ({len(lengths)} lengths x {len(depths)} depths x {samples_per_cell}) built in "
         f"{built - started:.1f} s; running them through the engine")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([s["token_ids"] for s in samples], params, use_tqdm=use_tqdm)
    finished = time.perf_counter()
    if len(outputs) != len(samples):
        raise RuntimeError(f"generate returned {len(outputs)} outputs for {len(samples)} prompts")

    records = []
    for s, out in zip(samples, outputs):
        score = string_match_all([clean_prediction(out.text)], [[s["reference"]]])
        rec = {k: v for k, v in s.items() if k not in ("prompt", "token_ids")}
        records.append({**rec, "prediction": out.text, "output_tokens": len(getattr(out, "token_ids", None) or []),
                        "finish_reason": getattr(out, "finish_reason", None), "score": score, "passed": passed(score)})
    summary = summarize(records, lengths, depths)

    engine_s = finished - built
    prompt_tokens = sum(s["prompt_tokens"] for s in samples)
    output_tokens = sum(r["output_tokens"] for r in records)
    timings = {
        "build_prompts_s": round(built - started, 3),
        "engine_s": round(engine_s, 3),
        "prompts_per_s": round(len(records) / engine_s, 4) if engine_s > 0 else None,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "tokens_per_s": round((prompt_tokens + output_tokens) / engine_s, 1) if engine_s > 0 else None,
    }
    model = str(getattr(config, "model", "") or "")
    name = Path(model).name or model or "model"
    run_config = {"model": model, "lengths": lengths, "depths": depths, "haystack": haystack,
                  "samples_per_cell": samples_per_cell, "template": template, "seed": seed,
                  "max_new_tokens": MAX_NEW_TOKENS, "max_model_len": limit, "metric": "string_match_all"}
    table = markdown_grid(summary)
    speed = (f"{len(records)} prompts in {engine_s:.1f} s: {timings['prompts_per_s']} prompts/s, "
             f"{timings['tokens_per_s']} tokens/s ({prompt_tokens} prompt + {output_tokens} output tokens)")
    files = {"json": out_dir / "needle.json", "markdown": out_dir / "needle.md"}
    files["json"].write_text(json.dumps({"config": run_config, "summary": summary, "timings": timings,
                                         "records": records}, indent=1, ensure_ascii=False) + "\n")
    title = f"Needle in a haystack: {name} ({haystack}, {template})"
    files["markdown"].write_text(f"# {title}\n\n{table}\n\n{speed}\n")
    chart = save_heatmap(summary, out_dir / "needle.png", title=title)
    if chart is not None:
        files["heatmap"] = chart
    print(f"\n{title}\n\n{table}\n\n{speed}\nresults: {out_dir}")
    return {"config": run_config, "summary": summary, "records": records, "timings": timings,
            "files": {k: str(v) for k, v in files.items()}, "markdown": table}


def summarize(records: list[dict], lengths: list[int], depths: list[float]) -> dict:
    """The grid: mean score per (depth, length) cell, per length, and overall (0-100, 2 decimals)."""
    cells: dict[tuple[float, int], list[float]] = {(d, n): [] for d in depths for n in lengths}
    for r in records:
        cells[(float(r["depth"]), int(r["length"]))].append(float(r["score"]))
    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 2) if xs else None

    scores = [[mean(cells[(d, n)]) for n in lengths] for d in depths]
    length_means = [mean([s for d in depths for s in cells[(d, n)]]) for n in lengths]
    all_scores = [float(r["score"]) for r in records]
    return {"lengths": lengths, "depths": depths, "scores": scores, "length_means": length_means,
            "overall": mean(all_scores), "passed": sum(passed(s) for s in all_scores), "total": len(all_scores)}


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _depth_label(d: float) -> str:
    return f"{d:g}%"


def _score_label(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}")


def markdown_grid(summary: dict) -> str:
    """Rows: depths, then the per-length mean; columns: lengths; cells: mean score (0-100)."""
    lengths = summary["lengths"]
    lines = ["| depth \\ length | " + " | ".join(_length_label(n) for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for d, row in zip(summary["depths"], summary["scores"]):
        lines.append(f"| {_depth_label(d)} | " + " | ".join(_score_label(x) for x in row) + " |")
    lines.append("| **mean** | " + " | ".join(f"**{_score_label(x)}**" for x in summary["length_means"]) + " |")
    lines += ["", f"Overall: {_score_label(summary['overall'])} mean score, {summary['passed']}/{summary['total']} "
                  f"needles found (string_match_all, 0-100)."]
    return "\n".join(lines)


def save_heatmap(summary: dict, path: str | Path, title: str = "Needle in a haystack") -> Path | None:
    """imshow of the grid: depth on y (0 at the top), length on x, score 0-100 as colour, cells annotated.

    Returns None (with a warning) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'nanovllm[ruler]'): skipping the needle heatmap",
                      stacklevel=2)
        return None
    import numpy as np

    lengths, depths = summary["lengths"], summary["depths"]
    grid = np.array([[np.nan if x is None else x for x in row] for row in summary["scores"]], dtype=float)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.0 * len(lengths) + 3), max(4.0, 0.42 * len(depths) + 2)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", interpolation="nearest")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            x = grid[i, j]
            dark = not np.isnan(x) and (x <= 15 or x >= 85)  # the ends of RdYlGn are dark
            ax.text(j, i, "-" if np.isnan(x) else _score_label(round(float(x), 1)), ha="center", va="center",
                    fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([_length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)))
    ax.set_yticklabels([_depth_label(d) for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (% of haystack)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="score (0-100)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _log(msg: str) -> None:
    print(f"[nanovllm.needle] {msg}", file=sys.stderr, flush=True)


# ---- command line ------------------------------------------------------------------------------

def parse_length(text: str) -> int:
    """4096, 4k or 4K (x1024)."""
    t = str(text).strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length: {text!r}") from None


def add_needle_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", type=parse_length, nargs="+", default=list(DEFAULT_LENGTHS), metavar="LEN",
                        help="context lengths in tokens (prompt + %d new tokens), e.g. 1024 4k 8K "
                             "(default: 1k 2k 4k 8k)" % MAX_NEW_TOKENS)
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS), metavar="PCT",
                        help="needle depths in percent of the haystack, 0 = start, 100 = end "
                             "(default: 0 10 20 ... 100)")
    parser.add_argument("--samples-per-cell", type=int, default=1, metavar="N",
                        help="prompts per (length, depth) cell, each with its own needle (default: 1)")
    parser.add_argument("--haystack", choices=HAYSTACKS, default="essay",
                        help="essay: Paul Graham essays, needle between sentences (RULER niah_single_2); "
                             "noise: repeated filler lines, needle on its own line (niah_single_1) (default: essay)")
    parser.add_argument("--template", choices=TEMPLATE_KINDS, default="chat",
                        help="chat: the model's chat template + answer prefix; base: bare task text + answer "
                             "prefix (default: chat)")
    parser.add_argument("--output", default="needle_results",
                        help="output directory for needle.json, needle.md and needle.png (default: needle_results)")
    parser.add_argument("--data-seed", type=int, default=DEFAULT_SEED,
                        help=f"seed of the needles' keys and values (default: {DEFAULT_SEED})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_options(parser)


def cmd_needle(args: argparse.Namespace) -> dict:
    from nanovllm import LLM

    _check_grid(args.lengths, args.depths)  # refuse bad arguments before loading the model
    if args.samples_per_cell < 1:
        raise ValueError(f"--samples-per-cell must be >= 1, got {args.samples_per_cell}")
    options = engine_options(args)
    options.setdefault("max_model_len", max(args.lengths))
    data.ensure_ruler_data()  # install and verify the data before loading the model
    llm = LLM(args.model, **options)
    return run_needle(llm, args.lengths, args.depths, args.output, args.haystack, args.samples_per_cell,
                      args.template, args.data_seed, use_tqdm=not args.no_progress)


def add_needle_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `needle` command to a `nanovllm` subparsers object; its func is cmd_needle."""
    parser = subparsers.add_parser(
        "needle", help="needle-in-a-haystack sweep over context lengths and depths, with a heatmap",
        description="Needle in a haystack (RULER niah_single prompts) over context lengths x needle depths; "
                    "writes needle.json, needle.md and a needle.png heatmap.")
    add_needle_arguments(parser)
    parser.set_defaults(func=cmd_needle)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm needle",
                                     description="Needle-in-a-haystack sweep over context lengths and depths.")
    add_needle_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`nanovllm needle ...` without the word `needle`: main(["--lengths", "1k", "2k"])."""
    run_command(cmd_needle, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
