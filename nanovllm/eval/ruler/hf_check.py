"""Cross-check: the same RULER prompts through HF transformers' greedy generate, scored the same way."""
from __future__ import annotations

from collections import defaultdict

import torch
from tqdm.auto import tqdm


def hf_predictions(model_dir: str, token_ids: list[list[int]], max_new: list[int], batch_size: int = 32,
                   device: str | None = None, use_tqdm: bool = True) -> list[str]:
    """Greedy HF generate over left-padded batches of prompts with equal max_new_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    groups: dict[int, list[int]] = defaultdict(list)
    for i, m in enumerate(max_new):
        groups[m].append(i)
    predictions: list[str] = [""] * len(token_ids)
    bar = tqdm(total=len(token_ids), desc="HF transformers", disable=not use_tqdm)
    for m, idx in groups.items():
        idx.sort(key=lambda i: len(token_ids[i]))
        for start in range(0, len(idx), batch_size):
            batch = idx[start : start + batch_size]
            width = max(len(token_ids[i]) for i in batch)
            ids = torch.tensor([[pad] * (width - len(token_ids[i])) + token_ids[i] for i in batch], device=device)
            mask = torch.tensor([[0] * (width - len(token_ids[i])) + [1] * len(token_ids[i]) for i in batch],
                                device=device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=m, do_sample=False, pad_token_id=pad)
            for row, i in enumerate(batch):
                predictions[i] = tokenizer.decode(out[row, width:], skip_special_tokens=True)
            bar.update(len(batch))
    bar.close()
    return predictions
