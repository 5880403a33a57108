"""Numerical error of a prefill against a reference: what each layer's attention and the final logits
look like at chosen prompt positions, for one engine configuration (dtype, chunking, offload).

`prefill_tap` runs one prompt through an engine (prompt logprobs on, so every position's logits are
computed, chunk by chunk) and keeps, at the chosen positions, the logits and each layer's attention
output (after o_proj). `compare` gives max and mean absolute differences against a reference tap.
Used by bench/precision_probe.py (fp32 vs bf16, chunked, offloaded, HF) and by the CPU test that
bounds chunked and offloaded bf16 error by the unchunked bf16 error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanovllm.sampling_params import SamplingParams


@dataclass
class Tap:
    positions: list[int]
    logits: torch.Tensor  # [len(positions), vocab] float32, on the CPU
    attention: list[torch.Tensor] = field(default_factory=list)  # per layer [len(positions), hidden] float32
    generated: list[int] = field(default_factory=list)  # greedy tokens after the prompt (decode steps)


@dataclass
class Error:
    logits_max: float
    logits_mean: float
    attention_max: list[float]  # per layer
    attention_mean: list[float]


def probe_positions(length: int, tail: int = 64, stride: int = 61) -> list[int]:
    """Positions spread over the prompt (every stride-th) plus its last `tail`: the long-range rows
    where accumulated error shows most."""
    return sorted(set(range(0, length, stride)) | set(range(max(0, length - tail), length)))


class _RowPicker:
    """Keeps the rows of a stream of row blocks (arriving in position order) that fall on `positions`."""

    def __init__(self, positions: list[int]):
        self.wanted = torch.tensor(positions)
        self.seen = 0
        self.kept: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor) -> None:
        lo, hi = self.seen, self.seen + rows.shape[0]
        take = self.wanted[(self.wanted >= lo) & (self.wanted < hi)] - lo
        if take.numel():
            self.kept.append(rows[take.to(rows.device)].float().cpu())
        self.seen = hi

    def result(self) -> torch.Tensor:
        return torch.cat(self.kept)


def prefill_tap(llm, prompt: list[int], positions: list[int], decode_steps: int = 0) -> Tap:
    """Run prompt's prefill in `llm` (an LLM) alone, then decode_steps greedy decode steps, and capture
    logits and attention outputs at positions (those >= len(prompt) are decode steps' rows)."""
    model = llm.runner.model
    logits_rows = _RowPicker(positions)
    layer_rows = [_RowPicker(positions) for _ in model.model.layers]
    compute_logits = model.compute_logits

    def tapped_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = compute_logits(hidden)
        logits_rows.add(out)
        return out

    hooks = [layer.self_attn.register_forward_hook(lambda _m, _i, out, r=rows: r.add(out))
             for layer, rows in zip(model.model.layers, layer_rows)]
    model.compute_logits = tapped_logits
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=decode_steps + 1, prompt_logprobs=0,
                                                    ignore_eos=True), use_tqdm=False)[0]
    finally:
        del model.compute_logits
        for hook in hooks:
            hook.remove()
    return Tap(positions, logits_rows.result(), [r.result() for r in layer_rows], out.token_ids)


def compare(tap: Tap, reference: Tap, rows: slice = slice(None)) -> Error:
    """Errors over the tap's rows (a slice of its positions)."""

    def stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        diff = (a - b).abs()
        return diff.max().item(), diff.mean().item()

    logits_max, logits_mean = stats(tap.logits[rows], reference.logits[rows])
    layers = [stats(a[rows], b[rows]) for a, b in zip(tap.attention, reference.attention)]
    return Error(logits_max, logits_mean, [m for m, _ in layers], [m for _, m in layers])
