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

from nanovllm.host_arrays import list_to_device, tables_to_device
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
        cu = list(itertools.accumulate(query_lens, initial=0))

        return AttentionMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=list_to_device(slot_mapping, torch.int64, device),
            cu_query_lens=list_to_device(cu, torch.int32, device),
            seq_lens_tensor=list_to_device(seq_lens, torch.int32, device),
            block_tables_tensor=tables_to_device(block_tables, -1, device),
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
            cu = list(itertools.accumulate(query_lens, initial=0))
            shared["cu_query_lens"] = list_to_device(cu, torch.int32, device)
            shared["slot_mapping"] = list_to_device([], torch.int64, device)
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
        starts = list(itertools.accumulate(meta.query_lens, initial=0))
        grouped: set[int] = set()
        if host_kv is None or host_kv.key_codes is None:
            key = ("torch decode groups", host_kv.base if host_kv else None)  # the same for every layer of the step
            if key not in meta.plans:
                meta.plans[key] = _decode_plan(meta, starts, k_cache.shape[1], key[1])
            for plan in meta.plans[key]:
                _attend_decode_rows(q, (k_cache, v_cache), plan, scale, out, host_kv)
                grouped.update(plan.seqs)
        for i, (query_len, seq_len, table) in enumerate(zip(meta.query_lens, meta.seq_lens, meta.block_tables_tensor)):
            if i in grouped:
                continue
            start = starts[i]
            ki = gather_tokens(k_cache, table, seq_len, host_k, base).transpose(0, 1)[None]
            vi = gather_tokens(v_cache, table, seq_len, host_v, base).transpose(0, 1)[None]
            if query_len == 1:  # one query sees every key: a KV head's group of query heads as its rows, no mask
                qi = q[start].reshape(1, ki.shape[1], group, q.shape[-1])  # [1, Hk, group, D]
                out[start] = F.scaled_dot_product_attention(qi, ki, vi, scale=scale).reshape(q.shape[1:])
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
        return out


# Decode rows attended together gather their KV padded to the longest: a group keeps that padding small and the
# gathered tensor small (past that, one SDPA call per row costs little next to its KV, and large fresh tensors
# cost page faults on the CPU).
MAX_GROUP_TOKENS = 1 << 12  # rows x longest KV length of one group
PAD_SLACK = 1.25  # rows x longest at most this times the group's KV tokens (plus 16 per row)


def _decode_groups(rows: list[int], seq_lens: list[int]) -> list[list[int]]:
    """rows (decode rows, one query each) in groups of similar KV length, shortest first."""
    groups, group, total = [], [], 0
    for i in sorted(rows, key=seq_lens.__getitem__):
        longest, n = seq_lens[i], len(group) + 1  # sorted: i is the longest so far
        if group and (n * longest > MAX_GROUP_TOKENS or n * longest > PAD_SLACK * (total + longest) + 16 * n):
            groups.append(group)
            group, total = [], 0
        group.append(i)
        total += seq_lens[i]
    return groups + [group] if group else groups


@dataclass
class _DecodeGroup:
    """Decode rows attended together (one query each, every key visible): where their tokens are, padded to the
    longest. Past its length a row reads its own first token again (masked out, but finite where the slot itself
    may hold anything)."""

    seqs: list[int]
    rows: torch.Tensor  # [B] their query rows
    visible: torch.Tensor  # [B, length] keys within each row's length
    slots: torch.Tensor  # [B * length] flat slots in the device cache (0 where on the host)
    host_slots: torch.Tensor | None = None  # ... in the second pool, where a table entry >= its base
    on_host: torch.Tensor | None = None  # [B * length]


def _decode_plan(meta: AttentionMetadata, starts: list[int], block_size: int, host_base: int | None
                 ) -> list[_DecodeGroup]:
    """The step's decode rows in groups of at least two (a row alone takes the per-sequence path), token slots
    gathered token by token (a block's unused tail is not copied)."""
    device = meta.seq_lens_tensor.device
    decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
    plan = []
    for seqs in _decode_groups(decode, meta.seq_lens):
        if len(seqs) < 2:
            continue
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        positions = torch.arange(max(meta.seq_lens[i] for i in seqs), device=device)
        visible = positions < meta.seq_lens_tensor.index_select(0, index)[:, None]
        tables = meta.block_tables_tensor.index_select(0, index)[:, positions // block_size]
        tables = torch.where(visible, tables, tables[:, :1])
        slots = tables * block_size + torch.where(visible, positions % block_size, 0)
        group = _DecodeGroup(seqs, torch.tensor([starts[i] for i in seqs], dtype=torch.int64, device=device), visible,
                             slots.flatten())
        if host_base is not None:
            on_host = tables >= host_base
            group.host_slots = torch.where(on_host, slots - host_base * block_size, 0).flatten()
            group.slots = torch.where(on_host, 0, slots).flatten()
            group.on_host = on_host.flatten()
        plan.append(group)
    return plan


def _attend_decode_rows(q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], group: _DecodeGroup,
                        scale: float, out: torch.Tensor, host_kv: HostKV | None = None) -> None:
    """A group's rows in one gather and one SDPA call: each KV head's query heads are the rows of its [1, group]
    query, keys past a row's length masked out. host_kv (without key codes): the second pool of the group's
    host slots."""
    num_seqs, length = group.visible.shape
    num_kv_heads, head_dim = caches[0].shape[2], q.shape[-1]

    def gather(cache: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:  # [B, Hk, length, D]
        tokens = _tokens(cache, group.slots)
        if group.on_host is not None:
            tokens = torch.where(group.on_host[:, None], _tokens(host, group.host_slots).to(tokens.device), tokens)
        return tokens.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)

    qi = q.index_select(0, group.rows).view(num_seqs, num_kv_heads, -1, head_dim)
    keys = gather(caches[0], host_kv.k if host_kv else None)
    values = gather(caches[1], host_kv.v if host_kv else None)
    oi = F.scaled_dot_product_attention(qi, keys, values, attn_mask=group.visible[:, None, None, :], scale=scale)
    out.index_copy_(0, group.rows, oi.reshape(num_seqs, *q.shape[1:]))


def _tokens(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [len(slots), Hk * D] of a [blocks, block_size, Hk, D] cache, by flat slot (block * block_size + offset)."""
    flat = cache.view(-1, cache.shape[2] * cache.shape[3]) if cache.is_contiguous() else cache.flatten(0, 1)
    return flat.index_select(0, slots.to(cache.device)).view(len(slots), -1)  # 2-D where it can: torch's faster path


def _rows_with_keys(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """Indices of the query rows whose sequence has at least one key."""
    rows = [r for n, s, start in zip(meta.query_lens, meta.seq_lens, meta.cu_query_lens.tolist()) if s > 0
            for r in range(start, start + n)]
    return torch.tensor(rows, dtype=torch.int64, device=device)
