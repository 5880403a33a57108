"""Quest's decode page choice against dense attention on real RULER samples, end to end (generated answers scored).

`bench/quest_recall.py` measures the attention mass a rule keeps on a few teacher-forced decode steps; that proxy
did not predict RULER (docs/BENCHMARKS.md, sixteenth session). This runs the engine itself: the same prompts are
generated once per rule in one engine (prefix caching shares the prefills, which are dense under every rule), only
the page scores Quest ranks are replaced (`QuestSelector.batch_block_scores`), and each rule's answers are scored
as RULER scores them. Rules, each per KV head over 16-token pages, the top `quest_token_budget` tokens of pages
plus the sink and the most recent block as the engine keeps them:

- full: no page dropped (the budget covers the context);
- engine: the engine's own scores, unreplaced (the same as group max, through the engine's code);
- group max: Quest's bound, the paper's rule (each query head's upper bound sum_d max(q_d max_d, q_d min_d), the maximum over the
  KV head's query heads);
- oracle: the true softmax mass of each page (q . k over the page's keys), summed over the group: the best any
  bound-free rule could choose at this budget (needs the keys: device pool only);
- oracle max: the true mass, the maximum over the group's query heads;
- group softmax: each query head's bounds as a softmax over the pages, summed over the group;
- softmax max: each query head's bounds as a softmax over the pages, the maximum over the group (the bound put on
  each head's own scale before the heads compete);
- mean query: the bound of the group's mean query;
- exact max: the largest true score q . k on the page (what the bound bounds from above), the maximum over the group;
- sparq R: each query head's approximate scores from its R largest |q_d| channels of every key (SparQ), the
  largest on each page, the maximum over the group (reads R of head_dim channels of every key);
- label R: the same from R channels fixed per layer and KV head (Double Sparsity's label cache: a device copy of
  those channels of every key), chosen once, on the first decode step seen, by the group's mean |q_d| times the
  keys' mean |k_d|, and kept for every later step and sample;
- fp8 / int8 / int4 keys max: exact max through a copy of every key in that format, one scale per token and KV head
  (what a device-resident compressed key copy would rank by);
- refine Nx: the group max's top N x budget pages as candidates, ranked by oracle max computed over the candidates,
  the sink and the recent block only (the keys such a rule would read);
- rerank Nx: the engine's own `quest_rerank=N` (the bound's top N x budget pages ranked by their exact largest score;
  the engine's default is 2, the other rules run with 1).

CPU or GPU (eager steps), page selection only:

    python bench/quest_rules.py --model ~/.cache/nanovllm/smollm2-135m --samples-file .models/smol_ruler_4k8k.json.gz \\
        --tasks niah_multivalue niah_multiquery --lengths 8192 --samples 8 --rules full "group max" oracle
"""
from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.eval.ruler.run import load_samples
from nanovllm.eval.ruler.scoring import sample_score
from nanovllm.eval.ruler.tasks import TASKS, resolve_tasks
from nanovllm.eval.ruler.templates import Prompter
from nanovllm.layers.block_selector import DecodeLayout
from nanovllm.layers.quest import QuestSelector

RULES = ("full", "engine", "group max", "oracle", "oracle max", "group softmax", "softmax max", "mean query",
         "exact max", "refine 2x", "refine 4x", "refine 8x", "rerank 2x", "rerank 4x", "rerank 8x",
         "sparq 8", "sparq 16", "label 4", "label 8", "label 16", "fp8 keys max", "int8 keys max",
         "int4 keys max")


def head_bounds(selector: QuestSelector, layer: int, q: torch.Tensor, layout: DecodeLayout) -> torch.Tensor:
    """[B, Hk, group, pages]: each query head's Quest bound on each page of its sequence's blocks."""
    lo, hi = selector.metadata.layout_pages(layer, layout)  # [B, pages, Hk, D]
    lo, hi = lo.float().permute(0, 2, 3, 1), hi.float().permute(0, 2, 3, 1)  # [B, Hk, D, pages]
    q = q.float().view(q.shape[0], lo.shape[1], -1, q.shape[-1])
    return q.clamp(min=0) @ hi + q.clamp(max=0) @ lo


def quantized(k: torch.Tensor, kind: str) -> torch.Tensor:
    """k [..., D] through a key copy of `kind` ("fp8": e4m3; "int8", "int4": symmetric integers) with one scale per
    token and KV head (its largest |k_d|), back in float32."""
    scale = k.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    if kind == "fp8":
        return (k / scale * 448).to(torch.float8_e4m3fn).float() * scale / 448
    levels = {"int8": 127, "int4": 7}[kind]
    return (k / scale * levels).round() * scale / levels


def head_logits(selector: QuestSelector, layer: int, q: torch.Tensor, layout: DecodeLayout,
                key_copy: str | None = None) -> torch.Tensor:
    """[B, Hk, group, tokens]: each query head's true scores (keys read from the device pool, through `quantized`
    when key_copy names a kind), -inf past the keys."""
    keys = selector.device_keys[layer]  # [blocks, block_size, Hk, D]
    if bool(layout.on_host.any()):
        raise ValueError("the oracle rules read keys from the device pool: run without offload")
    batch = layout.blocks.shape[0]
    k = keys[layout.blocks.clamp(min=0)].flatten(1, 2).float()  # [B, tokens, Hk, D]
    if key_copy is not None:
        k = quantized(k, key_copy)
    q = q.float().view(batch, k.shape[2], -1, q.shape[-1])  # [B, Hk, group, D]
    logits = torch.einsum("bhgd,bthd->bhgt", q, k) / math.sqrt(q.shape[-1])
    present = torch.arange(k.shape[1], device=q.device)[None, :] < layout.seq_lens[:, None]
    return logits.masked_fill(~present[:, None, None, :], float("-inf"))


def head_mass(selector: QuestSelector, layer: int, q: torch.Tensor, layout: DecodeLayout,
              visible: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hk, group, pages]: each query head's true softmax mass on each page; visible [B, Hk, pages]: the
    softmax over these pages' keys only."""
    logits = head_logits(selector, layer, q, layout)
    if visible is not None:
        tokens = visible.repeat_interleave(selector.metadata.page_size, -1)[:, :, None, : logits.shape[-1]]
        logits = logits.masked_fill(~tokens, float("-inf"))
    p = torch.softmax(logits, -1)
    return p.view(*p.shape[:-1], -1, selector.metadata.page_size).sum(-1)


def only_channels(q: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D] with all but the channels [B or 1, Hk, group, R] of each query head zeroed: its scores against
    full keys are those of the channels alone."""
    heads = q.view(q.shape[0], channels.shape[1], -1, q.shape[-1])
    keep = torch.zeros_like(heads).scatter(-1, channels.expand(q.shape[0], -1, -1, -1), 1.0)
    return (heads * keep).flatten(1, 2)


LABEL_CHANNELS: dict[tuple[int, int], torch.Tensor] = {}  # (layer, R): [1, Hk, group, R], chosen once


def label_channels(selector: QuestSelector, layer: int, q: torch.Tensor, layout: DecodeLayout, r: int):
    """The layer's R label channels per KV head, chosen at its first call (the group's mean |q_d| times the mean
    |k_d| of the step's keys) and returned unchanged after."""
    if (layer, r) not in LABEL_CHANNELS:
        keys = selector.device_keys[layer][layout.blocks.clamp(min=0)].flatten(1, 2).float()
        key_size = keys.abs().mean((0, 1))  # [Hk, D]
        q_size = q.float().view(q.shape[0], key_size.shape[0], -1, q.shape[-1]).abs().mean((0, 2))  # [Hk, D]
        top = (q_size * key_size).topk(r, -1).indices.sort(-1).values  # [Hk, R]
        group = q.shape[1] // key_size.shape[0]
        LABEL_CHANNELS[(layer, r)] = top[None, :, None, :].expand(1, -1, group, -1).contiguous()
    return LABEL_CHANNELS[(layer, r)]


def refined(self: QuestSelector, layer: int, q: torch.Tensor, layout: DecodeLayout, factor: int) -> torch.Tensor:
    """[B, Hk, pages]: the group max's top factor x budget pages of the middle, ranked by the oracle max over
    them with the sink and the recent block (other pages -inf)."""
    bound = head_bounds(self, layer, q, layout).amax(2).masked_fill(~_holding(self, layout)[:, None], float("-inf"))
    per_block = self.metadata.pages_per_block
    sink, recent = self.sink_blocks * per_block, self.recent_blocks * per_block
    ends = layout.valid.sum(1) * per_block  # [B] page columns
    column = torch.arange(bound.shape[-1], device=bound.device)[None, :]
    middle = (column >= sink) & (column < (ends - recent)[:, None])  # [B, pages]
    fixed = ((column < sink) | (column >= (ends - recent)[:, None])) & (column < ends[:, None])
    count = min(factor * self._budget(layout.block_size), bound.shape[-1])
    top = bound.masked_fill(~middle[:, None], float("-inf")).topk(count, -1)
    candidates = torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    mass = head_mass(self, layer, q, layout, candidates | fixed[:, None]).amax(2)
    return mass.masked_fill(~candidates, float("-inf"))


def rule_scores(rule: str):
    """A replacement for QuestSelector.batch_block_scores ranking pages by `rule`."""
    def scores(self: QuestSelector, layer, q, num_kv_heads, layout, pages=False):
        if not pages:
            raise ValueError("bench/quest_rules.py compares page selections (quest_page_select=True)")
        scale = 1 / math.sqrt(q.shape[-1])
        if rule == "group max":
            s = head_bounds(self, layer, q, layout).amax(2)
        elif rule == "oracle":
            s = head_mass(self, layer, q, layout).sum(2)
        elif rule == "oracle max":
            s = head_mass(self, layer, q, layout).amax(2)
        elif rule in ("group softmax", "softmax max"):
            b = head_bounds(self, layer, q, layout)
            p = torch.softmax(b.masked_fill(~_holding(self, layout)[:, None, None], float("-inf")) * scale, -1)
            s = p.sum(2) if rule == "group softmax" else p.amax(2)
        elif rule == "exact max" or rule.endswith("keys max") or rule.startswith(("sparq", "label")):
            if rule.startswith("sparq"):
                r = int(rule.split()[1])
                q = only_channels(q, q.view(q.shape[0], num_kv_heads, -1, q.shape[-1]).abs().topk(r, -1).indices)
            elif rule.startswith("label"):
                q = only_channels(q, label_channels(self, layer, q, layout, int(rule.split()[1])))
            logits = head_logits(self, layer, q, layout, rule.split()[0] if rule.endswith("keys max") else None)
            s = logits.view(*logits.shape[:-1], -1, self.metadata.page_size).amax(-1).amax(2)
        elif rule.startswith("refine"):
            s = refined(self, layer, q, layout, int(rule.split()[1].rstrip("x")))
        elif rule == "mean query":
            mean = q.view(q.shape[0], num_kv_heads, -1, q.shape[-1]).mean(2, keepdim=True)
            s = head_bounds(self, layer, mean.expand(-1, -1, 1, -1).flatten(1, 2), layout).amax(2)
        else:
            raise ValueError(f"unknown rule {rule!r}")
        return s.masked_fill(~_holding(self, layout)[:, None], float("-inf"))
    return scores


def _holding(selector: QuestSelector, layout: DecodeLayout) -> torch.Tensor:
    """[B, pages] pages that hold keys."""
    pages = layout.blocks.shape[1] * selector.metadata.pages_per_block
    written = -(-layout.seq_lens // selector.metadata.page_size)
    return torch.arange(pages, device=layout.seq_lens.device)[None, :] < written[:, None]


def run_rule(llm: LLM, selector: QuestSelector, rule: str, prompts: list[list[int]], params: list[SamplingParams]):
    budget, rerank = selector.token_budget, selector.rerank
    original = QuestSelector.batch_block_scores
    if rule == "full":
        selector.token_budget = 1 << 30
    elif rule.startswith("rerank"):
        selector.rerank = int(rule.split()[1].rstrip("x"))
    elif rule != "engine":
        QuestSelector.batch_block_scores = rule_scores(rule)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        QuestSelector.batch_block_scores = original
        selector.token_budget, selector.rerank = budget, rerank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples-file", required=True)
    parser.add_argument("--tasks", nargs="+", default=["niah_multivalue"], help="RULER task names, or all")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--samples", type=int, default=8, help="per task and length")
    parser.add_argument("--batch", type=int, default=8, help="prompts per generate call (each rule runs a batch)")
    parser.add_argument("--rules", nargs="+", default=["full", "group max", "oracle"], choices=RULES)
    parser.add_argument("--budget", type=int, default=2048, help="quest_token_budget")
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--output", default=None, help="JSON of every prediction")
    args = parser.parse_args()
    tasks = resolve_tasks(args.tasks)
    chosen = [s for s in load_samples(args.samples_file) if s["task"] in tasks and s["length"] in args.lengths]
    by_cell = defaultdict(list)
    for s in chosen:
        by_cell[(s["task"], s["length"])].append(s)
    samples = [s for cell in by_cell.values() for s in cell[: args.samples]]
    options = {k: v for k, v in (("num_gpu_blocks", args.num_gpu_blocks), ("dtype", args.dtype)) if v is not None}
    # quest_rerank=1: each rule's ranking alone ("rerank Nx" sets the engine's own rerank); the rules need the bounds
    llm = LLM(args.model, sparse_policy="quest", sparse_min_context=0, quest_token_budget=args.budget,
              quest_rerank=1, quest_key_copy="none", enforce_eager=True, max_model_len=max(args.lengths), **options)
    selector = llm.runner.worker.selector
    prompter = Prompter(llm.tokenizer, "chat")
    records = []
    for start in range(0, len(samples), args.batch):
        batch = samples[start : start + args.batch]
        prompts = [prompter.encode(s["prompt"]) for s in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=s["max_new_tokens"]) for s in batch]
        for rule in args.rules:
            began = time.perf_counter()
            outputs = run_rule(llm, selector, rule, prompts, params)
            for s, out in zip(batch, outputs):
                score = sample_score(TASKS[s["task"]].metric, out.text, s["references"])
                records.append({"rule": rule, "task": s["task"], "length": s["length"], "index": s["index"],
                                "score": score, "prediction": out.text})
            print(f"samples {start}-{start + len(batch) - 1} {rule}: "
                  f"{sum(r['score'] for r in records[-len(batch):]) / len(batch):.1f} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
    print_table(records, args.rules)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)


def print_table(records: list[dict], rules: list[str]) -> None:
    cells = defaultdict(list)
    for r in records:
        cells[(r["task"], r["length"], r["rule"])].append(r["score"])
    rows = sorted({(t, n) for t, n, _ in cells})
    print("| task | length | samples | " + " | ".join(rules) + " |")
    print("|---|---|---|" + "---|" * len(rules))
    for task, length in rows:
        scores = [cells[(task, length, rule)] for rule in rules]
        print(f"| {task} | {length} | {len(scores[0])} | " + " | ".join(f"{sum(s) / len(s):.1f}" for s in scores) + " |")
    means = [sum(sum(cells[(t, n, rule)]) / len(cells[(t, n, rule)]) for t, n in rows) / len(rows) for rule in rules]
    print("| **average** | | | " + " | ".join(f"**{m:.2f}**" for m in means) + " |")


if __name__ == "__main__":
    main()
