"""The "triton" attention backend: Triton kernels over the paged KV cache.

Decode steps (every sequence has one new token) use the split-KV decode kernel, which reads only the
metadata tensors (cu_query_lens, seq_lens_tensor, block_tables_tensor) and picks its number of
splits from their shapes, so it can be captured in a CUDA graph. Other steps (prefill, chunked
prefill) use the varlen prefill kernel, whose work schedule is built on the host from meta.query_lens;
in a mixed batch the one-token sequences go to the decode kernel, the others to the prefill kernel,
both writing into the same output. A step of one long sequence goes to torch's cuDNN attention on
Hopper instead (layers/cudnn_prefill.py: faster there). This module imports without Triton; creating the backend needs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanovllm.layers.attention import AttentionBackend, AttentionMetadata, register_attention_backend
from nanovllm.layers.cudnn_prefill import cudnn_prefill, takes_cudnn_route

if TYPE_CHECKING:
    from nanovllm.kernels.triton_paged_attention import PrefillConfig


@dataclass
class PrefillPlan:
    """What a non-decode step needs besides the metadata tensors; built once per step, on the host."""

    config: PrefillConfig
    schedule: torch.Tensor  # int32 [num_work, 2] (sequence, query tile) for the prefill kernel
    decode_ids: torch.Tensor | None  # int32 one-token sequences of a mixed batch, for the decode kernel
    longest_decode: int  # their longest seq_len (picks the decode kernel's number of splits)
    cudnn: bool = False  # one long sequence: torch's cuDNN attention instead (layers/cudnn_prefill.py)


@register_attention_backend("triton")
class TritonPagedAttention(AttentionBackend):
    supports_cuda_graphs = True
    prefill_through_cudnn = True  # one long prefill sequence through cuDNN where takes_cudnn_route says so
    pack_heads = False  # the prefill kernel's programs over a KV head's query heads (PrefillConfig.pack_heads)
    # the decode and merge kernels as dependent launches (kernels/dependent_launch.py; Hopper+, a no-op elsewhere),
    # set beside TritonLayerOps.dependent_launch (benches' --no-dependent-launch turns both off)
    dependent_launch = True

    def __init__(self) -> None:
        try:
            from nanovllm.kernels import triton_paged_attention
        except ImportError as e:
            raise RuntimeError("the 'triton' attention backend needs the triton package") from e
        self.ops = triton_paged_attention

    def forward(self, q, k_cache, v_cache, meta, scale, host_kv=None):
        if host_kv is None:
            return self.forward_with_lse(q, k_cache, v_cache, meta, scale)[0]
        if not is_decode_step(q, meta):
            raise ValueError("host-resident KV is read in place by decode steps only")
        return self.ops.paged_decode_attention(q, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens_tensor,
                                               meta.block_tables_tensor, scale, host_kv=host_kv,
                                               pdl=self.dependent_launch)[0]

    def forward_with_lse(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (out [T, Hq, D], lse [T, Hq] float32 natural log) over the cache (new K/V already stored)."""
        tensors = (q, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens_tensor, meta.block_tables_tensor, scale)
        if is_decode_step(q, meta):
            return self.ops.paged_decode_attention(*tensors, out=out, pdl=self.dependent_launch)
        plan = self._plan(q, k_cache, meta)
        if plan.cudnn and out is None:
            return cudnn_prefill(q, k_cache, v_cache, meta, scale)
        out = self.ops.paged_prefill_attention(*tensors, schedule=plan.schedule, config=plan.config, out=out)
        if plan.decode_ids is not None:
            self.ops.paged_decode_attention(*tensors, seq_ids=plan.decode_ids, max_seq_len=plan.longest_decode, out=out,
                                            pdl=self.dependent_launch)
        return out

    def history_attention(self, q, k_cache, v_cache, meta, scale, out):
        tensors = (q, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens_tensor, meta.block_tables_tensor, scale)
        plan = self._plan(q, k_cache, meta, history=True)
        if plan.schedule.shape[0]:
            self.ops.paged_prefill_attention(*tensors, schedule=plan.schedule, config=plan.config, out=out,
                                             causal=False, accumulate=True)
        if plan.decode_ids is not None:
            self.ops.paged_decode_attention(*tensors, seq_ids=plan.decode_ids, max_seq_len=plan.longest_decode,
                                            out=out, accumulate=True, pdl=self.dependent_launch)

    def _plan(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, history: bool = False) -> PrefillPlan:
        """The step's plan, kept in the metadata and reused by every layer (same shapes)."""
        group = q.shape[1] // k_cache.shape[2]
        key = ("history" if history else "prefill", q.dtype, q.shape[-1], k_cache.shape[1], group, self.pack_heads,
               q.device)
        if key not in meta.plans:
            build = self._build_history_plan if history else self._build_plan
            config = self.ops.prefill_config(q.dtype, q.shape[-1], k_cache.shape[1], self.pack_heads)
            meta.plans[key] = build(config, config.tile_queries(group), meta, q.device)
            meta.plans[key].cudnn = not history and self.prefill_through_cudnn and takes_cudnn_route(q, k_cache, meta)
        return meta.plans[key]

    def _build_history_plan(self, config: PrefillConfig, tile: int, meta: AttentionMetadata,
                            device: torch.device) -> PrefillPlan:
        """Sequences with keys: several rows go to the prefill kernel (query tiles of `tile`), one row to the
        decode kernel."""
        with_keys = [n if s > 0 else 0 for n, s in zip(meta.query_lens, meta.seq_lens)]
        schedule = self.ops.build_prefill_schedule(with_keys, tile, device, meta.seq_lens, skip_single_token=True)
        decode = [i for i, n in enumerate(with_keys) if n == 1]
        if not decode:
            return PrefillPlan(config, schedule, None, 0)
        decode_ids = torch.tensor(decode, dtype=torch.int32).to(device, non_blocking=True)
        return PrefillPlan(config, schedule, decode_ids, max(meta.seq_lens[i] for i in decode))

    def _build_plan(self, config: PrefillConfig, tile: int, meta: AttentionMetadata,
                    device: torch.device) -> PrefillPlan:
        """Sequences with several new tokens go to the prefill kernel (query tiles of `tile`); in a mixed batch
        the one-token ones go to the decode kernel (GQA-grouped, split over long contexts) instead."""
        decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
        mixed = 0 < len(decode) < meta.num_seqs
        schedule = self.ops.build_prefill_schedule(meta.query_lens, tile, device, meta.seq_lens,
                                                   skip_single_token=mixed)
        if not mixed:
            return PrefillPlan(config, schedule, None, 0)
        decode_ids = torch.tensor(decode, dtype=torch.int32).to(device, non_blocking=True)
        return PrefillPlan(config, schedule, decode_ids, max(meta.seq_lens[i] for i in decode))


def is_decode_step(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """One new token per sequence. T == num_seqs with every query_len <= 1 means all are exactly 1."""
    return meta.num_seqs > 0 and q.shape[0] == meta.num_seqs and max(meta.query_lens) == 1
