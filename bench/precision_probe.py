"""Where bf16 error comes from in a long prefill: one prompt through the model in float32 (the reference)
and in bfloat16 unchunked, chunked, and offloaded (single pass over a ring slot, and split pieces merged
by log-sum-exp), next to HF transformers' own bf16 error against its float32 on the same weights.

Prints, per mode, the final logits' max and mean absolute error against the float32 reference at
probe positions (every 61st and the last 64), the ratio to our unchunked bf16 error, and the mean error
of each layer's attention output; JSON to $OUT (else bench/results).

    PYTHONPATH=. python3 bench/precision_probe.py MODEL_DIR [--length 32768] [--chunks 8192 4096 1024]
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
from pathlib import Path

import torch

from nanovllm import LLM
from nanovllm.config import load_hf_config
from nanovllm.engine.offload import host_pool
from nanovllm.eval.precision import Tap, compare, prefill_tap, probe_positions

HERE = Path(__file__).resolve().parent


def prompt_tokens(model_dir: str, length: int) -> list[int]:
    """Real text that needs no download: this repository's own sources, repeated to the length (random
    ids for a model without a tokenizer)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        vocab = load_hf_config(model_dir)["vocab_size"]
        return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    from transformers import AutoTokenizer

    text = "\n".join(p.read_text() for p in sorted(HERE.parent.glob("nanovllm/**/*.py")))
    ids = AutoTokenizer.from_pretrained(model_dir)(text).input_ids
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def block_bytes_per_layer(model_dir: str, block_size: int = 256) -> int:
    """K and V of one block in one layer, in bf16."""
    c = load_hf_config(model_dir)
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * block_size * heads * head_dim * 2


def our_tap(model: str, prompt: list[int], positions: list[int], device: str, decode_steps: int,
            ring_blocks: int | None = None, **options) -> Tap:
    saved = host_pool.RING_SLOT_BYTES
    if ring_blocks is not None:  # ring slots of ring_blocks blocks: the split path, host KV in pieces
        host_pool.RING_SLOT_BYTES = ring_blocks * block_bytes_per_layer(model)
    try:
        max_len = len(prompt) + decode_steps + 1
        options.setdefault("num_gpu_blocks", -(-max_len // 256) + 1)  # the KV it needs, not 90% of the card
        llm = LLM(model, device=device, max_model_len=max_len, enable_prefix_caching=False, enforce_eager=True,
                  **options)
        tap = prefill_tap(llm, prompt, positions, decode_steps)
    finally:
        host_pool.RING_SLOT_BYTES = saved
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return tap


def hf_tap(model_dir: str, prompt: list[int], positions: list[int], dtype: torch.dtype, device: str) -> Tap:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    index = torch.tensor(positions, device=device)
    attention: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(
        lambda _m, _i, out: attention.append(out[0][0, index].float().cpu())) for layer in model.model.layers]
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt], device=device)).last_hidden_state[0, index]
        logits = model.lm_head(hidden).float().cpu()
    for hook in hooks:
        hook.remove()
    del model
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return Tap(positions, logits, attention)


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def row(name: str, tap: Tap, reference: Tap, num_prefill: int, unchunked: dict | None) -> dict:
    """Errors of the prefill rows, and of the decode rows while the greedy tokens still agree."""
    error = compare(tap, reference, slice(0, num_prefill))
    agree = same_prefix(tap.generated, reference.generated)
    decode_rows = min(agree, len(tap.positions) - num_prefill)
    decode = compare(tap, reference, slice(num_prefill, num_prefill + decode_rows)) if decode_rows else None
    ratio = error.logits_mean / unchunked["logits_mean"] if unchunked else 1.0
    layers = error.attention_mean
    picks = sorted({0, len(layers) // 2, len(layers) - 1})
    decode_text = f"decode mean {decode.logits_mean:8.5f} over {decode_rows} steps" if decode else "decode -"
    print(f"{name:28s} prefill logits max {error.logits_max:7.4f} mean {error.logits_mean:8.5f} ({ratio:5.2f}x "
          f"unchunked bf16); {decode_text}; greedy tokens equal for {agree}; attention mean err, layers {picks}: "
          + " ".join(f"{layers[i]:.2e}" for i in picks), flush=True)
    return {"mode": name, "logits_max": error.logits_max, "logits_mean": error.logits_mean,
            "ratio_to_unchunked_bf16": ratio, "attention_max": error.attention_max, "attention_mean": layers,
            "decode_logits_mean": decode.logits_mean if decode else None, "decode_logits_max":
            decode.logits_max if decode else None, "decode_rows_compared": decode_rows, "tokens_agreeing": agree}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="HF-format model directory (real weights)")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--chunks", type=int, nargs="*", default=[8192, 4096, 1024])
    ap.add_argument("--offload-blocks", type=int, default=16, help="device KV blocks in the offload modes")
    ap.add_argument("--split-ring-blocks", type=int, default=8, help="ring slot size of the split-pieces mode")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--decode-steps", type=int, default=32, help="greedy decode steps compared after the prefill")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    prompt = prompt_tokens(args.model, args.length)
    num_prefill = len(probe_positions(len(prompt)))
    positions = probe_positions(len(prompt)) + list(range(len(prompt), len(prompt) + args.decode_steps))
    tap = functools.partial(our_tap, args.model, prompt, positions, args.device, args.decode_steps)
    whole = dict(max_num_batched_tokens=len(prompt))
    reference = tap(dtype="float32", **whole)
    modes = {"bf16 unchunked": dict(whole)}
    modes.update({f"bf16 chunks of {c}": dict(max_num_batched_tokens=c) for c in args.chunks})
    offload = dict(enable_cpu_offload=True, num_gpu_blocks=args.offload_blocks, cpu_kv_cache_gb=4.0)
    modes["bf16 offload, single pass"] = offload
    modes[f"bf16 offload, {args.split_ring_blocks}-block pieces"] = dict(offload, ring_blocks=args.split_ring_blocks)
    results: list[dict] = []
    for name, options in modes.items():
        results.append(row(name, tap(dtype="bfloat16", **options), reference, num_prefill,
                           results[0] if results else None))
    if not args.skip_hf:  # HF's own bf16 error, against our float32 (equal to HF float32 within 1e-4 in the tests)
        hf = hf_tap(args.model, prompt, positions[:num_prefill], torch.bfloat16, args.device)
        results.append(row("HF bf16 (sdpa) vs our fp32", hf, reference, num_prefill, results[0]))
    out = Path(os.environ.get("OUT") or HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"precision_probe_{len(prompt)}.json").write_text(json.dumps({"length": len(prompt), "rows": results},
                                                                        indent=1))


if __name__ == "__main__":
    main()
