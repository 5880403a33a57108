"""RMSNorm with HF Llama's numerics: normalise in float32, cast to the input dtype, then scale."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 with torch's fused kernel, cast back, then scale: HF Llama's order.
        # (Scaling before the cast, as F.rms_norm on half inputs does, changes SmolLM2's bf16 answers.)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)
