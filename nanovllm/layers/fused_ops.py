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

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); residual None: (rms_norm(x), x)."""
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        return self.add_rms_norm(x, residual, weight, eps)

    def qkv_rope(self, x: torch.Tensor, linear: nn.Linear, heads: tuple[int, int, int], cos: torch.Tensor,
                 sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) of the q/k/v projection of x (heads: Hq, Hk, D), q and k
        through `qk_norm_rope`; store (k_cache, v_cache, slots): k and v also written at the slots."""
        q, k, v = _split_heads(self.linear(x, linear), heads)
        q, k = self.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, store=None if store is None else (v, *store))
        return q, k, v

    def gate_up_silu(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """silu(gate) * up of the gate/up projection [gate | up] of x."""
        return self.silu_and_mul(self.linear(x, linear))

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


def _split_heads(qkv: torch.Tensor, heads: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (Hq + 2 Hk) * D] -> views q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]."""
    num_heads, num_kv_heads, head_dim = heads
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.unflatten(-1, (num_heads, head_dim)), k.unflatten(-1, (num_kv_heads, head_dim)), \
        v.unflatten(-1, (num_kv_heads, head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TritonLayerOps(LayerOps):
    """Fused Triton kernels on a GPU (or the Triton interpreter). Steps of at most gemv_rows rows (default 1:
    batch-1 decode) run each narrow projection (a one-rank nn.Linear with at most twice as many outputs as inputs:
    q/k/v, o, down) through the Triton GEMV (kernels/triton_gemv.py), which reads the weights faster than
    cuBLAS at one row; wider ones (gate/up) and larger steps keep cuBLAS. 0 turns it off (a bench peer sets it,
    then recaptures the decode graphs). dependent_launch: the GEMV, norm, SiLU and RoPE kernels start while the
    kernel before them ends (kernels/dependent_launch.py; Hopper+, a no-op elsewhere; benches' --no-dependent-launch
    turns it off: -0.13 / -0.17 ms a batch-1 token at 1K / 32K on the H200, docs/BENCHMARKS.md)."""

    name = "triton"

    def __init__(self, gemv_rows: int = 1, dependent_launch: bool = True) -> None:
        from nanovllm.kernels import triton_fused, triton_gemv

        if not 0 <= gemv_rows <= triton_gemv.MAX_ROWS:
            raise ValueError(f"gemv_rows={gemv_rows} is outside 0..{triton_gemv.MAX_ROWS}")
        self.kernels = triton_fused
        self.gemv, self.gemv_rope, self.gemv_silu = triton_gemv.gemv, triton_gemv.gemv_rope, triton_gemv.gemv_silu
        self.gemv_rows = gemv_rows
        self.dependent_launch = dependent_launch

    def _through_gemv(self, x: torch.Tensor, linear: nn.Linear, wide: bool = False) -> bool:
        """A one-rank nn.Linear of a step of at most gemv_rows rows, at most twice as many outputs as inputs unless
        wide: the gate/up projection with SiLU in the epilogue (H100, Llama-3.1-8B's MLP at batch 1 in a graph of
        dependent launches: 114.3 us a layer against 121.8 through cuBLAS and the SiLU kernel,
        docs/results/fortysecond/mlp_chain.py)."""
        if not 1 <= x.shape[0] <= self.gemv_rows or type(linear) is not nn.Linear:  # most calls end here
            return False
        weight = linear.weight
        return ((wide or weight.shape[0] <= 2 * weight.shape[1]) and x.dtype == weight.dtype and x.stride(-1) == 1
                and weight.stride(1) == 1)

    def linear(self, x, linear):
        if self._through_gemv(x, linear):
            return self.gemv(x, linear.weight, linear.bias, pdl=self.dependent_launch)
        return linear(x)

    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, pdl=self.dependent_launch).view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.rms_norm(x, weight, eps, residual, pdl=self.dependent_launch)

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up, pdl=self.dependent_launch)

    def gate_up_silu(self, x, linear):
        if self._through_gemv(x, linear, wide=True):  # SiLU * up in the GEMV's epilogue (gemv_silu)
            return self.gemv_silu(x, linear.weight, linear.bias, pdl=self.dependent_launch)
        return super().gate_up_silu(x, linear)

    def qk_norm_rope(self, q, k, cos, sin, q_weight, k_weight, eps, store=None):
        return self.kernels.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, store, pdl=self.dependent_launch)

    def qkv_rope(self, x, linear, heads, cos, sin, q_weight, k_weight, eps, store=None):
        """Through the GEMV (steps of gemv_rows rows), without a q/k norm: RoPE and the store in its epilogue, one
        launch fewer (kernels/triton_gemv.gemv_rope)."""
        if q_weight is not None or not self._through_gemv(x, linear):
            return super().qkv_rope(x, linear, heads, cos, sin, q_weight, k_weight, eps, store)
        num_heads, num_kv_heads, head_dim = heads
        qkv = self.gemv_rope(x, linear.weight, linear.bias, head_dim, num_heads, num_kv_heads, cos, sin, store,
                             pdl=self.dependent_launch)
        return _split_heads(qkv, heads)


_LAYER_OPS = {"torch": LayerOps, "triton": TritonLayerOps}


def get_layer_ops(name: str) -> LayerOps:
    if name not in _LAYER_OPS:
        raise ValueError(f"unknown layer ops {name!r}; available: {sorted(_LAYER_OPS)}")
    return _LAYER_OPS[name]()
