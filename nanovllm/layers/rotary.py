"""Rotary position embedding (rotate-half layout) with default, linear and llama3 frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        # A plain float32 tensor, not a buffer: model.to(dtype) must not round the frequencies.
        self.inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables [T, 1, D] for these positions; computed once per forward, shared by all layers."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

