"""RMSNorm with HF Llama's numerics: normalise in float32, cast to the input dtype, then scale."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.fused_ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops or LayerOps()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
