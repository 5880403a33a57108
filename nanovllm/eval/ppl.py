"""Sliding-window perplexity from prompt log-probabilities (`nanovllm ppl`).

Windows follow the usual strided recipe: a window of at most max_length tokens starts every
`stride` tokens, and only the tokens not scored by the previous window are scored (each with the
whole window before it as context). The first token of the text is never scored. All windows go to
the engine as one batch.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from nanovllm.engine_args import add_engine_options, engine_options
from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Window:
    begin: int
    end: int
    num_scored: int  # the last num_scored tokens of [begin, end) are scored


def sliding_windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    if max_length < 2 or not 0 < stride <= max_length:
        raise ValueError(f"need max_length >= 2 and 0 < stride <= max_length, got {max_length}, {stride}")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        windows.append(Window(begin, end, min(end - prev_end, end - begin - 1)))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def perplexity(llm, token_ids: list[int], max_length: int, stride: int, use_tqdm: bool = True) -> dict:
    windows = sliding_windows(len(token_ids), max_length, stride)
    prompts = [token_ids[w.begin : w.end] for w in windows]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    nll, count = 0.0, 0
    for w, prompt, out in zip(windows, prompts, outputs):
        scored = range(len(prompt) - w.num_scored, len(prompt))
        nll -= sum(out.prompt_logprobs[i][prompt[i]] for i in scored)
        count += w.num_scored
    return {"perplexity": math.exp(nll / count), "nll": nll, "scored_tokens": count, "windows": len(windows),
            "max_length": max_length, "stride": stride}


def add_ppl_parser(subparsers) -> None:
    p = subparsers.add_parser("ppl", help="sliding-window perplexity of a text file")
    p.add_argument("--model", default=None, help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--file", required=True, help="UTF-8 text file to score")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per window")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    p.add_argument("--output", default=None, help="write the result as JSON here")
    add_engine_options(p)
    p.set_defaults(func=cmd_ppl)


def cmd_ppl(args: argparse.Namespace) -> None:
    from nanovllm import LLM

    options = engine_options(args)
    options.setdefault("max_model_len", args.max_length + 1)
    llm = LLM(args.model, **options)
    ids = llm.tokenizer(Path(args.file).read_text()).input_ids
    result = perplexity(llm, ids, args.max_length, args.stride)
    print(f"perplexity {result['perplexity']:.4f} over {result['scored_tokens']} tokens in {result['windows']} windows")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
