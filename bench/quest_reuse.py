"""How much of Quest's page selection carries over from one decode step to the next, on real RULER prompts.

Per sparse layer and KV head, a decode step keeps the top `quest_token_budget` tokens' worth of 16-token pages (plus
the sink and the most recent block, not counted here). The share of a step's kept pages that one of the previous W
steps kept too is the hit rate an on-device cache of the last W steps' kept pages would have, so in offload mode
the share of host page reads it would save; the cache's size is the union of those W selections (reported in
budgets). `--random-weights`: the model's shape with random weights (what the speed benches run), for comparison.
One prompt at a time (batch 1), eager steps, the engine's own Quest (its default ranking, the int8 key copy), CPU
or GPU:

    python bench/quest_reuse.py --model ~/.cache/nanovllm/smollm2-135m \\
        --samples-file .models/smol_ruler_4k8k.json.gz --tasks niah_single_1 niah_multikey_1 --lengths 8192 \\
        --samples 2 --new-tokens 32 --budget 1024 [--windows 1 2 4 8] [--random-weights]
    python bench/quest_reuse.py --model bench/configs/llama-3.1-8b --random-weights --random-prompts 2 \\
        --lengths 131072 --dtype bfloat16       # the speed benches' model and prompts (a GPU)
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.eval.ruler.run import load_samples
from nanovllm.eval.ruler.tasks import resolve_tasks
from nanovllm.eval.ruler.templates import Prompter


def record_selections(selector) -> dict[int, list[torch.Tensor]]:
    """Wrap selector.narrow: per layer, each call's kept middle pages [Hk, budget] (batch 1; -1 for none)."""
    kept: dict[int, list[torch.Tensor]] = defaultdict(list)
    narrow = selector.narrow

    def recording(layer, q, num_kv_heads, layout, key_reads=None, rows=None):
        out = narrow(layer, q, num_kv_heads, layout, key_reads, rows)
        if out is not None:
            per_block = layout.block_size // selector.decode_page_size(layout.block_size)
            sink, recent = selector.sink_blocks * per_block, selector.recent_blocks * per_block
            kept[layer].append(out[0, :, sink : out.shape[-1] - recent].cpu())
        return out

    selector.narrow = recording
    return kept


def reuse(steps: list[torch.Tensor], window: int) -> tuple[int, int, int, int]:
    """(kept pages hit, kept pages, pages held, selections) over steps [Hk, budget] of one layer: a step's kept pages
    that one of the previous `window` steps kept, and the size of those steps' union (the cache), summed over the
    (step, head) selections from step `window` on."""
    hits = total = held = count = 0
    for t in range(window, len(steps)):
        for head in range(steps[t].shape[0]):
            now = set(steps[t][head].tolist()) - {-1}
            cache = set().union(*(set(steps[t - w][head].tolist()) for w in range(1, window + 1))) - {-1}
            hits, total, held, count = hits + len(now & cache), total + len(now), held + len(cache), count + 1
    return hits, total, held, count


def sample_prompts(llm: LLM, args) -> list[tuple[str, list[int]]]:
    """The first --samples of each task and length in --samples-file, through the model's chat template."""
    tasks = resolve_tasks(args.tasks)
    by_cell = defaultdict(list)
    for s in load_samples(args.samples_file):
        if s["task"] in tasks and s["length"] in args.lengths:
            by_cell[(s["task"], s["length"])].append(s)
    prompter = Prompter(llm.tokenizer, "chat")
    return [(f"{s['task']} {s['length']} #{s['index']}", prompter.encode(s["prompt"]))
            for cell in by_cell.values() for s in cell[: args.samples]]


def random_prompts(llm: LLM, args) -> list[tuple[str, list[int]]]:
    """--random-prompts prompts of random tokens, each leaving room for --new-tokens in max_model_len."""
    g = torch.Generator().manual_seed(0)
    length, vocab = llm.config.max_model_len - args.new_tokens - 16, llm.config.hf_config["vocab_size"]
    return [(f"random prompt {i} of {length} tokens", torch.randint(0, vocab, (length,), generator=g).tolist())
            for i in range(args.random_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples-file", help="RULER samples (nanovllm ruler --save-samples)")
    parser.add_argument("--random-prompts", type=int, default=0,
                        help="instead of samples: this many prompts of random tokens, as long as --lengths allows")
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1"], help="RULER task names, or all")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--samples", type=int, default=2, help="per task and length")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps per prompt (past EOS too)")
    parser.add_argument("--budget", type=int, default=2048, help="quest_token_budget")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--random-weights", action="store_true", help="the model's shape with random weights")
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    if not (args.samples_file or args.random_prompts):
        parser.error("give --samples-file or --random-prompts")
    options = {"dtype": args.dtype} if args.dtype else {}
    llm = LLM(args.model, sparse_policy="quest", sparse_min_context=0, quest_token_budget=args.budget,
              enforce_eager=True, max_model_len=max(args.lengths),
              load_format="dummy" if args.random_weights else "auto", **options)
    selector = llm.runner.worker.selector
    prompts = sample_prompts(llm, args) if args.samples_file else random_prompts(llm, args)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    totals = {w: [0, 0, 0, 0] for w in args.windows}
    budget_pages = None
    for name, prompt in prompts:
        kept = record_selections(selector)
        llm.generate([prompt], params, use_tqdm=False)
        del selector.narrow  # the class's method again
        for steps in kept.values():
            budget_pages = steps[0].shape[-1]
            for w in args.windows:
                for i, n in enumerate(reuse(steps, w)):
                    totals[w][i] += n
        hit1 = totals[args.windows[0]]
        print(f"{name}: {len(kept)} sparse layers, running hit rate at window "
              f"{args.windows[0]} {hit1[0] / max(hit1[1], 1):.3f}", flush=True)
    print(f"| window (steps) | kept pages found in the window | cache size (budgets of {budget_pages} pages) |")
    print("|---|---|---|")
    for w, (hits, total, held, count) in totals.items():
        print(f"| {w} | {hits / max(total, 1):.3f} | {held / max(count, 1) / budget_pages:.2f} |")


if __name__ == "__main__":
    main()
