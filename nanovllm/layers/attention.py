"""Attention backends over the paged KV cache.

A backend owns the per-batch metadata it needs (`build_metadata`) and computes attention for one
layer given that metadata. The metadata is passed down the model's forward explicitly: there is no
global forward context. `TorchPagedAttention` is the pure-PyTorch path: it runs on any device and is
the reference that faster kernels are tested against.
"""
from __future__ import annotations

import itertools

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanovllm.kernels.reference import HostKV, gather_tokens, merge_attention_states, paged_attention_reference


@dataclass
class AttentionMetadata:
    """One step's batch: sequence i contributes query_lens[i] new tokens at the end of seq_lens[i]."""

    query_lens: list[int]
    seq_lens: list[int]  # tokens of KV after this step (cached + new)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    cu_query_lens: torch.Tensor  # [num_seqs + 1]
    seq_lens_tensor: torch.Tensor  # [num_seqs]
    block_tables_tensor: torch.Tensor  # [num_seqs, max_blocks], padded with -1
    block_size: int
    plans: dict = field(default_factory=dict)  # backend-owned per-step state (e.g. kernel work schedules)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    name: str
    supports_cuda_graphs = False  # True when the decode path reads only metadata tensors (no host lists)

    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [-1] * (max_blocks - len(t)) for t in block_tables]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)

        return AttentionMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=_to_device(slot_mapping, torch.int64, device),
            cu_query_lens=_to_device(cu, torch.int32, device),
            seq_lens_tensor=_to_device(seq_lens, torch.int32, device),
            block_tables_tensor=_to_device(padded, torch.int64, device),
            block_size=block_size,
        )

    def build_head_metadata(self, query_lens: list[int], head_seq_lens: torch.Tensor, head_tables: torch.Tensor,
                            block_size: int, device: torch.device, max_seq_lens: list[int] | None = None,
                            shared: dict | None = None) -> AttentionMetadata:
        """Metadata of a block-sparse selection: per sequence and KV head its own blocks and KV length
        (tables [B, Hk, max_blocks] padded with -1, seq_lens [B, Hk]); no KV is written with it, and its
        block tables exist as tensors only (block_tables is empty). max_seq_lens: per sequence a bound
        of its heads' lengths known on the host (else read from head_seq_lens: a sync on the device).
        shared: kept by the caller across the layers of a step whose query_lens and max_seq_lens are the
        same: the query offsets and the backend's plans (kernel work schedules) are then built once."""
        shared = {} if shared is None else shared
        if not shared:
            shared["cu_query_lens"] = _to_device(list(itertools.accumulate(query_lens, initial=0)), torch.int32, device)
            shared["slot_mapping"] = _to_device([], torch.int64, device)
            shared["plans"] = {}
        return AttentionMetadata(
            query_lens=query_lens, seq_lens=max_seq_lens or head_seq_lens.amax(-1).tolist(), block_tables=[],
            slot_mapping=shared["slot_mapping"], cu_query_lens=shared["cu_query_lens"],
            seq_lens_tensor=head_seq_lens.to(device=device, dtype=torch.int32, non_blocking=True).contiguous(),
            block_tables_tensor=head_tables.to(device=device, dtype=torch.int64, non_blocking=True),
            block_size=block_size, plans=shared["plans"],
        )

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        host_kv: HostKV | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; caches: [num_blocks, block_size, Hk, D], the step's new K/V already stored
        (KVAccess does that). Returns [T, Hq, D]. host_kv (decode steps):
        block-table entries >= host_kv.base name this layer's blocks in a second pool (an offload ring
        slot, or pinned host memory read in place), their keys in host_kv.key_codes when it is set."""

    @abstractmethod
    def forward_with_lse(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like forward, also returning the log-sum-exp [T, Hq] (float32, natural log) of each row's scores,
        so that attention over disjoint key sets can be merged. out: (out, lse) buffers to write into
        (out may be float32 to keep partial results unrounded)."""

    @abstractmethod
    def history_attention(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Non-causal attention of every query row over seq_lens[i] keys of its sequence in the given
        caches (KV history that precedes all of them), merged by log-sum-exp into out = (out, lse), the
        partial result over other keys (lse -inf where there is none). Rows of sequences with seq_len 0
        are left as they are."""


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(name: str):
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


_LAZY_BACKENDS = {"triton": "nanovllm.layers.triton_attention"}  # modules that need optional packages


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        import importlib

        importlib.import_module(_LAZY_BACKENDS[name])
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask letting new token j (at position seq_len - query_len + j) see keys up to itself."""
    if query_len == 1:
        return None
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    return torch.arange(seq_len, device=device)[None, :] <= q_pos


@register_attention_backend("torch")
class TorchPagedAttention(AttentionBackend):
    def forward_with_lse(self, q, k_cache, v_cache, meta, scale, out=None):
        result = paged_attention_reference(q, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens_tensor,
                                           meta.block_tables_tensor, scale)
        if out is None:
            return result
        out[0].copy_(result[0])
        out[1].copy_(result[1])
        return out

    def history_attention(self, q, k_cache, v_cache, meta, scale, out):
        part_out, part_lse = paged_attention_reference(q, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens_tensor,
                                                       meta.block_tables_tensor, scale, causal=False)
        rows = _rows_with_keys(meta, q.device)
        merged, merged_lse = merge_attention_states(out[0][rows], out[1][rows], part_out[rows], part_lse[rows])
        out[0][rows] = merged
        out[1][rows] = merged_lse

    def forward(self, q, k_cache, v_cache, meta, scale, host_kv=None):
        if meta.seq_lens_tensor.dim() == 2:  # per-KV-head selection: the float32 reference
            return paged_attention_reference(q, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens_tensor,
                                             meta.block_tables_tensor, scale, host_kv=host_kv)[0]
        host_k, host_v, base = (host_kv.keys, host_kv.v, host_kv.base) if host_kv else (None, None, None)
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        start = 0
        for query_len, seq_len, table in zip(meta.query_lens, meta.seq_lens, meta.block_tables_tensor):
            ki = gather_tokens(k_cache, table, seq_len, host_k, base).transpose(0, 1)[None]
            vi = gather_tokens(v_cache, table, seq_len, host_v, base).transpose(0, 1)[None]
            if query_len == 1:  # one query sees every key: a KV head's group of query heads as its rows, no mask
                qi = q[start].reshape(1, ki.shape[1], group, q.shape[-1])  # [1, Hk, group, D]
                out[start] = F.scaled_dot_product_attention(qi, ki, vi, scale=scale).view(q.shape[1:])
                start += 1
                continue
            qi = q[start : start + query_len].transpose(0, 1)[None]  # [1, Hq, n, D]: 4-D for the fused kernels
            if group > 1:  # explicit GQA expansion: SDPA's enable_gqa falls back to the slow math kernel
                ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
            if query_len == seq_len:  # no cached prefix: plain causal attention, the fastest SDPA path
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
            else:
                mask = causal_mask(query_len, seq_len, q.device)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start : start + query_len] = oi[0].transpose(0, 1)
            start += query_len
        return out


def _rows_with_keys(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """Indices of the query rows whose sequence has at least one key."""
    rows = [r for n, s, start in zip(meta.query_lens, meta.seq_lens, meta.cu_query_lens.tolist()) if s > 0
            for r in range(start, start + n)]
    return torch.tensor(rows, dtype=torch.int64, device=device)
