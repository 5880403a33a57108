"""How much of the true attention mass Quest's block choice keeps, against the best any choice could keep.

Runs real prompts (RULER samples) through a dense engine, records each decode step's queries and the keys
they attend to (post-RoPE, as the cache holds them), and then, per layer past Quest's dense ones, scores
the blocks as a selection rule would and measures, of each query head's softmax mass between the sink and
the most recent block (both always kept), the share on its KV head's chosen blocks. Rules compared at the same budget:

- group max: Quest as built (the page upper bound of each query head, the maximum over the query heads of
  a KV-head group, the top blocks per KV head);
- head union: each query head's own top blocks (budget / group size of them), united per KV head;
- group softmax: each query head's page bounds turned into a distribution (softmax at the attention's scale),
  summed over the group (an estimate of the group's mass, as the oracle sums the true one): the same key
  bounds, no head dominating by the size of its scores;
- midpoint softmax: the same over q . (min + max) / 2 per page (an estimate of a page's typical score, not a
  bound), from the same per-page minima and maxima;
- oracle: the blocks holding the most true mass of the group (the best any rule could do).

The share of mass kept is a proxy, not the accuracy: the midpoint softmax kept 0.94-0.97x of the oracle's mass
on Qwen 16K where the group max kept 0.81-0.88x, and lost more RULER points than the group max in every cell on
the H200 (docs/BENCHMARKS.md, sixteenth session).

Any block size can be simulated from one run (the keys do not depend on it). Prints, per rule, the mean
share kept, the mean of the worst query head's share (retrieval needs every head's), each as a ratio of
the oracle's, and the share of the mass on the needle's blocks (the answer's tokens in the prompt) kept. CPU or GPU:

    python bench/quest_recall.py --model ~/.cache/nanovllm/smollm2-135m \\
        --samples-file .models/smol_ruler_4k8k.json.gz --task niah_single_2 --lengths 4096 --samples 2
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.eval.ruler.run import load_samples
from nanovllm.eval.ruler.templates import Prompter
from nanovllm.layers import kv_access
from nanovllm.layers.quest import QUEST_PAGE_SIZE


@dataclass
class DecodeRecord:
    layer: int
    q: torch.Tensor  # [Hq, D]
    keys: torch.Tensor  # [seq_len, Hk, D]
    scale: float
    needle: list[int]  # positions of the answer's tokens in the prompt (empty: not found)


def record_decode_steps(llm: LLM, prompt: list[int], steps: int, needle: list[int]) -> list[DecodeRecord]:
    """Queries and keys of the first `steps` decode steps of one prompt, every layer."""
    records: list[DecodeRecord] = []
    attend = kv_access.DeviceKV.attend

    def recording(self, layer, q, k, v, scale):
        out = attend(self, layer, q, k, v, scale)
        if self.meta.query_lens == [1]:
            k_cache, _ = self.cache.layer(layer)
            n = self.meta.seq_lens[0]
            table = torch.tensor(self.meta.block_tables[0], dtype=torch.int64, device=k_cache.device)
            keys = k_cache.index_select(0, table).flatten(0, 1)[:n]
            records.append(DecodeRecord(layer, q[0].float().cpu(), keys.float().cpu(), scale, needle))
        return out

    kv_access.DeviceKV.attend = recording
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True), use_tqdm=False)
    finally:
        kv_access.DeviceKV.attend = attend
    return records


def head_block_mass(r: DecodeRecord, block: int) -> torch.Tensor:
    """True softmax mass of each query head on each block: [Hq, blocks]."""
    num_heads, num_kv = r.q.shape[0], r.keys.shape[1]
    keys = r.keys.repeat_interleave(num_heads // num_kv, 1)  # [n, Hq, D]
    p = torch.softmax(torch.einsum("hd,nhd->hn", r.q, keys) * r.scale, -1)
    return blocks_sum(p, block)


def head_block_bound(r: DecodeRecord, block: int, midpoint: bool = False) -> torch.Tensor:
    """Quest's upper bound of each query head on each block (the maximum over its 16-token pages): [Hq, blocks];
    with `midpoint` q . (min + max) / 2 per page instead of the bound."""
    n, num_kv, dim = r.keys.shape
    pages = -(-n // QUEST_PAGE_SIZE)
    padded = torch.cat([r.keys, r.keys[-1:].expand(pages * QUEST_PAGE_SIZE - n, num_kv, dim)])
    lo, hi = (f(padded.view(pages, QUEST_PAGE_SIZE, num_kv, dim), 1) for f in (torch.amin, torch.amax))
    group = r.q.shape[0] // num_kv
    lo, hi = lo.repeat_interleave(group, 1), hi.repeat_interleave(group, 1)  # [pages, Hq, D]
    page_bound = (r.q * (lo + hi) / 2 if midpoint else torch.maximum(r.q * hi, r.q * lo)).sum(-1).T  # [Hq, pages]
    per_block = block // QUEST_PAGE_SIZE
    blocks = -(-n // block)
    padded_bound = torch.full((page_bound.shape[0], blocks * per_block), float("-inf"))
    padded_bound[:, :pages] = page_bound
    return padded_bound.view(-1, blocks, per_block).amax(-1)


def blocks_sum(p: torch.Tensor, block: int) -> torch.Tensor:
    n = p.shape[-1]
    blocks = -(-n // block)
    return torch.nn.functional.pad(p, (0, blocks * block - n)).view(*p.shape[:-1], blocks, block).sum(-1)


def choose(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[rows, blocks] scores -> bool keep: the sink, the most recent block and the top `budget` of the rest."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[:, 0] = keep[:, -1] = True
    middle = scores[:, 1:-1]
    if middle.shape[1] > 0:
        top = middle.topk(min(budget, middle.shape[1]), dim=1).indices + 1
        keep.scatter_(1, top, True)
    return keep


def selections(mass: torch.Tensor, bound: torch.Tensor, midpoint: torch.Tensor, scale: float, num_kv: int,
               budget: int) -> dict[str, torch.Tensor]:
    """Per rule, keep [Hk, blocks]."""
    group = mass.shape[0] // num_kv

    def group_softmax(scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores[:, 1:-1] * scale, -1).view(num_kv, group, -1).sum(1)

    def with_ends(middle: torch.Tensor) -> torch.Tensor:  # the sink and the recent block are kept anyway
        return torch.nn.functional.pad(middle, (1, 1))

    union = choose(bound, max(1, budget // group)).view(num_kv, group, -1).any(1)
    return {"group max": choose(bound.view(num_kv, group, -1).amax(1), budget),
            "head union": union,
            "group softmax": choose(with_ends(group_softmax(bound)), budget),
            "midpoint softmax": choose(with_ends(group_softmax(midpoint)), budget),
            "oracle": choose(mass.view(num_kv, group, -1).sum(1), budget)}


def kept_mass(mass: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each query head's share of its mass between the sink and the most recent block (the part a rule
    chooses from; the two fixed blocks often hold most of it) on its KV head's kept blocks: [Hq]."""
    group = mass.shape[0] // keep.shape[0]
    middle = mass[:, 1:-1]
    kept = (middle * keep.repeat_interleave(group, 0)[:, 1:-1]).sum(-1)
    return kept / middle.sum(-1).clamp(min=1e-30)


def needle_positions(prompt: list[int], answer: list[int]) -> list[int]:
    """Where the answer's tokens stand in the prompt (the first match), or []."""
    n = len(answer)
    starts = [i for i in range(len(prompt) - n + 1) if prompt[i : i + n] == answer]
    return list(range(starts[0], starts[0] + n)) if starts and n else []


def evaluate(records: list[DecodeRecord], block: int, budget_tokens: int,
             dense_layers: int) -> dict[str, tuple[float, float, float]]:
    """Per rule, over the records: the mean share of a query head's mass kept, the mean of the worst head's
    share, and the share of the mass on the needle's blocks (the answer in the prompt) that is kept."""
    totals: dict[str, list[float]] = {}
    budget = max(1, budget_tokens // block)
    for r in records:
        if r.layer < dense_layers or math.ceil(r.keys.shape[0] / block) <= budget + 2:
            continue
        mass, bound, midpoint = head_block_mass(r, block), head_block_bound(r, block), head_block_bound(r, block, True)
        needle_blocks = sorted({p // block for p in r.needle})
        for rule, keep in selections(mass, bound, midpoint, r.scale, r.keys.shape[1], budget).items():
            kept = kept_mass(mass, keep)
            total = totals.setdefault(rule, [0.0, 0.0, 0.0, 0, 0])
            total[0] += kept.mean().item()
            total[1] += kept.min().item()
            total[3] += 1
            if needle_blocks:  # the needle's mass (over the group's heads) that the kept blocks hold
                group = mass.shape[0] // keep.shape[0]
                on_needle = mass[:, needle_blocks]
                kept_needle = (on_needle * keep[:, needle_blocks].repeat_interleave(group, 0)).sum()
                total[2] += (kept_needle / on_needle.sum().clamp(min=1e-30)).item()
                total[4] += 1
    return {rule: (mean / count, worst / count, needle / max(1, found))
            for rule, (mean, worst, needle, count, found) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples-file", required=True)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048])
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    samples = [s for s in load_samples(args.samples_file) if s["task"] == args.task and s["length"] in args.lengths]
    llm = LLM(args.model, sparse_policy="full", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=max(args.lengths), **({"device": args.device} if args.device else {}))
    prompter = Prompter(llm.tokenizer, "chat")
    for length in args.lengths:
        chosen = [s for s in samples if s["length"] == length][: args.samples]
        records = []
        for s in chosen:
            prompt = prompter.encode(s["prompt"])
            answer = llm.tokenizer.encode(s["references"][0], add_special_tokens=False)
            records += record_decode_steps(llm, prompt, args.decode_steps, needle_positions(prompt, answer))
        for block in args.block_sizes:
            for budget in args.budgets:
                result = evaluate(records, block, budget, args.dense_layers)
                oracle_mean, oracle_worst, _ = result["oracle"]
                cells = "; ".join(f"{rule}: {m:.3f} ({m / oracle_mean:.2f}x oracle), worst head {w:.3f} "
                                  f"({w / oracle_worst:.2f}x), needle mass kept {n:.2f}" for rule, (m, w, n) in result.items())
                print(f"{args.task} {length}, {len(chosen)} samples x {args.decode_steps} steps, block {block}, "
                      f"budget {budget}: share of the middle's mass kept: {cells}", flush=True)


if __name__ == "__main__":
    main()
