"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Sampling draws exponential noise E and takes argmax(p / E), which picks token i with probability
p_i; it is computed as argmax(scores - log E) on the filtered, temperature-scaled logits, which is the
same argmax without a softmax pass. The noise of a seeded request comes from its own generator, so
its tokens do not depend on what else is in the batch. On CUDA, batches without top-k/top-p/min-p use
a one-pass Triton kernel instead (Gumbel-max with in-kernel Philox noise: the same distribution).

Rows whose params adjust the logits (logit_bias, min_tokens, repetition/presence/frequency penalties)
go through `adjust_logits` first, in vLLM's order: bias, the min_tokens mask, then penalties; the
filters and either sampler then see the adjusted logits. Without such a row nothing of it runs.
Logprobs are those of the raw logits (vLLM's default `raw_logprobs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanovllm.sampling_params import SamplingParams


@dataclass
class RowHistory:
    """What the logit adjustments of one sampling row need beyond its params."""

    num_output_tokens: int  # generated before the token being sampled
    prompt_token_ids: list[int] | None = None  # with a repetition penalty
    output_token_ids: list[int] | None = None  # with any penalty
    stop_token_ids: list[int] = field(default_factory=list)  # masked while num_output_tokens < min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: sampled token and top-N, or None


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p; filtered entries become -inf.
    Which filters run is decided from the Python params, so the GPU is never synchronised."""
    device = logits.device
    vocab = logits.shape[-1]
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):
        logits = logits / _to(device, temps)[:, None]
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
        top_k = _to(device, [p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        top_p = _to(device, [p.top_p for p in params])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None]  # keep the smallest prefix reaching top_p (always >= 1 token)
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(p.min_p > 0 for p in params):
        min_p = _to(device, [p.min_p for p in params])
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    history: list[RowHistory | None] | None = None,
) -> SamplerOutput:
    """logits: [B, V] (any float dtype). Returns one token per row."""
    token_list = sample_on_device(logits, params, generators, default_generator, history).tolist()
    return SamplerOutput(token_list, _logprobs(logits, token_list, params))


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    history: list[RowHistory | None] | None = None,
) -> torch.Tensor:
    """The sampled tokens as an int64 tensor on logits' device, without waiting for the device.
    history: per row, what penalties and min_tokens need (None for rows without them). logits in any float
    dtype: the Triton sampler reads 16-bit ones as they are, the other paths work on a float32 copy."""
    if any(p.adjusts_logits for p in params):
        logits = adjust_logits(logits.float(), params, history or [None] * len(params))
    if _use_fused(logits, params):
        return _fused_sample(logits, params, generators, default_generator)
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    if not all(p.greedy for p in params):
        greedy = _to(logits.device, [p.greedy for p in params])
        scores = filter_logits(logits, params)
        noise = _exponential(scores.shape, default_generator, scores.device)
        for i, gen in enumerate(generators):
            if gen is not None:  # seeded requests draw from their own stream
                noise[i] = _exponential(scores.shape[1:], gen, scores.device)
        sampled = torch.sub(scores, noise.log_()).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens


def _exponential(shape: torch.Size, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Exp(1) noise as -log(U), U uniform: the distribution of Tensor.exponential_, whose CPU kernel is 4-7x slower
    (15 ms against 3.4 for a [16, 49152] batch on the 2-core VM: an eighth of a SmolLM2 decode step there)."""
    return torch.rand(shape, generator=generator, device=device).log_().neg_()


def _use_fused(logits: torch.Tensor, params: list[SamplingParams]) -> bool:
    return logits.is_cuda and not all(p.greedy for p in params) and not any(_filters(p, logits.shape[-1]) for p in params)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], history: list[RowHistory | None]) -> torch.Tensor:
    """A copy of logits with each row's logit_bias added, its stop tokens masked below min_tokens, and its
    repetition, presence and frequency penalties applied (vLLM's semantics)."""
    logits = logits.clone()
    _add_bias(logits, params)
    _mask_below_min_tokens(logits, params, history)
    rows = [i for i, p in enumerate(params) if p.penalizes]
    if rows:
        logits[_to(logits.device, rows)] = _penalize(logits[rows], [params[i] for i in rows], [history[i] for i in rows])
    return logits


def _add_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    entries = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if entries:
        rows, tokens, biases = zip(*entries)
        device = logits.device
        logits.index_put_((_to(device, list(rows)), _to(device, list(tokens))),
                          _to(device, list(biases)).to(logits.dtype), accumulate=True)


def _mask_below_min_tokens(logits: torch.Tensor, params: list[SamplingParams], history: list[RowHistory | None]) -> None:
    entries = [(i, t) for i, (p, h) in enumerate(zip(params, history))
               if p.min_tokens and _required(h, "min_tokens").num_output_tokens < p.min_tokens
               for t in h.stop_token_ids]
    if entries:
        rows, tokens = zip(*entries)
        logits[_to(logits.device, list(rows)), _to(logits.device, list(tokens))] = float("-inf")


def _penalize(logits: torch.Tensor, params: list[SamplingParams], history: list[RowHistory | None]) -> torch.Tensor:
    """logits [R, V] of rows with penalties: repetition over prompt + output tokens, presence and
    frequency over output tokens."""
    device, (num_rows, vocab) = logits.device, logits.shape
    history = [_required(h, "penalties") for h in history]
    counts = _token_counts([h.output_token_ids or [] for h in history], num_rows, vocab, device)
    in_output = counts > 0
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = in_output | (_token_counts([h.prompt_token_ids or [] for h in history], num_rows, vocab, device) > 0)
        rep = _to(device, repetition).to(logits.dtype)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    frequency = _to(device, [p.frequency_penalty for p in params]).to(logits.dtype)[:, None]
    presence = _to(device, [p.presence_penalty for p in params]).to(logits.dtype)[:, None]
    return logits - frequency * counts - presence * in_output


def _token_counts(token_lists: list[list[int]], num_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's list."""
    counts = torch.zeros(num_rows, vocab, device=device)
    rows = [i for i, tokens in enumerate(token_lists) for _ in tokens]
    if rows:
        tokens = [t for ts in token_lists for t in ts]
        counts.index_put_((_to(device, rows), _to(device, tokens)), torch.ones(len(rows), device=device), accumulate=True)
    return counts


def _required(history: RowHistory | None, what: str) -> RowHistory:
    if history is None:
        raise ValueError(f"sampling with {what} needs the row's token history")
    return history


def _to(device: torch.device, values: list) -> torch.Tensor:
    """A small per-row parameter tensor, copied without waiting for the device's queued work."""
    return torch.tensor(values).to(device, non_blocking=True)


def _filters(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def _fused_sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  default_generator: torch.Generator | None) -> torch.Tensor:
    """Temperature sampling in one Triton pass (kernels/triton_sampler.py): each row's Gumbel noise comes
    from a Philox seed drawn from its own generator when seeded, else from the default generator."""
    from nanovllm.kernels.triton_sampler import sample_tokens

    device = logits.device
    temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    seeds = torch.randint(0, 2**62, (len(params),), device=device, generator=default_generator)
    for i, gen in enumerate(generators):
        if gen is not None:
            seeds[i] = torch.randint(0, 2**62, (1,), device=device, generator=gen)[0]
    return sample_tokens(logits, temps.to(device, non_blocking=True), seeds)


def _logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[dict[int, float] | None]:
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return [None] * len(params)
    entries = logprob_entries(logits, tokens, [n or 0 for n in wanted])
    return [None if n is None else e for e, n in zip(entries, wanted)]


def logprob_entries(logits: torch.Tensor, tokens: list[int], top_n: int | list[int]) -> list[dict[int, float]]:
    """Per row: {token: logprob} of the given token first, then the row's top_n most likely tokens."""
    counts = top_n if isinstance(top_n, list) else [top_n] * len(tokens)
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # no float32 copy of 16-bit logits first
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1).tolist()
    entries = [{t: c} for t, c in zip(tokens, chosen)]
    if max(counts, default=0):
        top_vals, top_ids = logp.topk(max(counts), dim=-1)
        for entry, ids, vals, n in zip(entries, top_ids.tolist(), top_vals.tolist(), counts):
            for tid, val in zip(ids[:n], vals[:n]):
                entry.setdefault(tid, val)
    return entries
