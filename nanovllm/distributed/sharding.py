"""What each rank holds of a decoder: its attention heads, KV heads (split, or one replicated head when
there are fewer KV heads than ranks), MLP columns and vocabulary rows; and which slice of each checkpoint
tensor that is (`Placement`), so the loader reads only this rank's part."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanovllm.distributed.parallel_state import TensorParallel

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
VOCAB_PARALLEL = frozenset({"embed_tokens", "lm_head"})


@dataclass(frozen=True)
class Placement:
    """A checkpoint tensor goes to rows [row, ...) of `param`; dim None: the whole tensor, else its
    [start, start + size) slice along dim."""

    param: str
    row: int = 0
    dim: int | None = None
    start: int = 0
    size: int = 0


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={num_heads}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={num_kv_heads} must divide one "
                         "another (KV heads are split across ranks, or replicated when there are fewer)")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide intermediate_size={intermediate_size}")


def local_config(cfg, tp: TensorParallel):
    """A DecoderConfig with this rank's head and MLP counts (vocabulary and hidden size unchanged)."""
    if tp.size == 1:
        return cfg
    check_divisible(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=max(1, cfg.num_kv_heads // tp.size),
                               intermediate_size=cfg.intermediate_size // tp.size)


def first_kv_head(num_kv_heads: int, tp: TensorParallel) -> int:
    """The first KV head of this rank: its share, or the one head its query heads use when replicated."""
    if num_kv_heads >= tp.size:
        return tp.rank * (num_kv_heads // tp.size)
    return tp.rank // (tp.size // num_kv_heads)


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of this rank's vocabulary: ceil(V / N) rows each, the last rank fewer."""
    per_rank = -(-vocab_size // tp.size)
    start = tp.rank * per_rank
    size = min(vocab_size, start + per_rank) - start
    if size <= 0:
        raise ValueError(f"vocab_size={vocab_size} is too small for tensor_parallel_size={tp.size}")
    return start, size


def shard(module: str, leaf: str, local, full_kv_heads: int, tp: TensorParallel) -> tuple[int | None, int, int]:
    """(dim, start, size) of the checkpoint tensor `<module>.<leaf>` this rank keeps; dim None: all of it.
    local: this rank's DecoderConfig."""
    d = local.head_dim
    if module == "q_proj":
        return 0, tp.rank * local.num_heads * d, local.num_heads * d
    if module in ("k_proj", "v_proj"):
        return 0, first_kv_head(full_kv_heads, tp) * d, local.num_kv_heads * d
    if module in ("gate_proj", "up_proj"):
        return 0, tp.rank * local.intermediate_size, local.intermediate_size
    if module in ROW_PARALLEL and leaf == "weight":
        width = local.num_heads * d if module == "o_proj" else local.intermediate_size
        return 1, tp.rank * width, width
    if module in VOCAB_PARALLEL:
        return 0, *vocab_range(local.vocab_size, tp)
    return None, 0, 0
