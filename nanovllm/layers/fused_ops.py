"""The elementwise parts of a decoder layer (RMSNorm with the residual add, SiLU * up, q/k norm + RoPE),
as a swappable set of ops.

`LayerOps` is pure PyTorch with HF's numerics and runs anywhere: it is the reference. `TritonLayerOps`
computes the same in one fused Triton launch per op (nanovllm/kernels/triton_fused.py). A model gets
one instance at construction; the runner picks Triton ops together with the Triton attention backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.engine.kv_cache import store_kv


class LayerOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in float32 with torch's fused kernel, cast back, then scale: HF Llama's order.
        # (Scaling before the cast, as F.rms_norm on half inputs does, changes SmolLM2's bf16 answers.)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
        return weight * normed.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the residual stream's update and the next norm."""
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(rms_norm(x + residual)), x + residual); residual None: (linear(rms_norm(x)), x)."""
        if residual is None:
            return linear(self.rms_norm(x, weight, eps)), x
        normed, summed = self.add_rms_norm(x, residual, weight, eps)
        return linear(normed), summed

    def silu_linear(self, gate_up: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        return linear(self.silu_and_mul(gate_up))

    def linear(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        return linear(x)

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]: optional per-head RMSNorm, then rotate-half RoPE (cos, sin [T, 1, D]).
        store (v [T, Hk, D], k_cache, v_cache [num_blocks, block_size, Hk, D], slots [T]): the rotated k and v
        also written at the caches' flat slots."""
        if q_weight is not None:
            q, k = self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if store is not None:
            v, k_cache, v_cache, slots = store
            store_kv(k, v, k_cache, v_cache, slots)
        return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TritonLayerOps(LayerOps):
    """Fused Triton kernels on a GPU (or the Triton interpreter). gemv_rows: steps of at most this many rows run
    their projections (one-rank nn.Linear) through the Triton GEMV with the op before each fused in (the norm, SiLU
    * up); 0, the default: cuBLAS. Off: on the H200 the fused prologues made batch-1 decode 3x slower
    (docs/BENCHMARKS.md, thirty-third session); a bench peer sets it, then recaptures the decode graphs."""

    name = "triton"

    def __init__(self, gemv_rows: int = 0) -> None:
        from nanovllm.kernels import triton_fused, triton_gemv

        self.kernels = triton_fused
        self.gemv = triton_gemv.gemv
        self.gemv_rows = gemv_rows

    def _through_gemv(self, x: torch.Tensor, linear: nn.Linear) -> bool:
        return 1 <= x.shape[0] <= self.gemv_rows and type(linear) is nn.Linear and x.dtype == linear.weight.dtype

    def norm_linear(self, x, residual, weight, eps, linear):
        if not self._through_gemv(x, linear):
            return super().norm_linear(x, residual, weight, eps, linear)
        if residual is None:
            return self.gemv(x, linear.weight, linear.bias, norm=(weight, eps)), x
        return self.gemv(x, linear.weight, linear.bias, norm=(weight, eps), residual=residual)

    def silu_linear(self, gate_up, linear):
        if not self._through_gemv(gate_up, linear):
            return super().silu_linear(gate_up, linear)
        return self.gemv(gate_up, linear.weight, linear.bias, silu_mul=True)

    def linear(self, x, linear):
        return self.gemv(x, linear.weight, linear.bias) if self._through_gemv(x, linear) else linear(x)

    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up)

    def qk_norm_rope(self, q, k, cos, sin, q_weight, k_weight, eps, store=None):
        return self.kernels.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, store)


_LAYER_OPS = {"torch": LayerOps, "triton": TritonLayerOps}


def get_layer_ops(name: str) -> LayerOps:
    if name not in _LAYER_OPS:
        raise ValueError(f"unknown layer ops {name!r}; available: {sorted(_LAYER_OPS)}")
    return _LAYER_OPS[name]()
