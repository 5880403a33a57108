"""What each rank holds of a decoder: its attention heads, KV heads (split, the first ranks one more where they do
not divide, or one replicated head when there are fewer KV heads than ranks), MLP columns (split alike) and
vocabulary rows; and which slice of each checkpoint tensor that is (`Placement`), so the loader reads only this
rank's part."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanovllm.config import check_shareable
from nanovllm.distributed.parallel_state import TensorParallel

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


def split(total: int, size: int, rank: int) -> tuple[int, int]:
    """(first, count) of rank's share of `total` items over `size` ranks: the first total % size ranks one more, so
    rank 0 (the driver, whose pool sizes set the block manager's host blocks) holds the most."""
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class HeadShare:
    """A rank's query heads and KV heads: [first_head, first_head + num_heads), [first_kv_head, ...)."""

    first_head: int
    num_heads: int
    first_kv_head: int
    num_kv_heads: int


def head_share(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShare:
    """The rank's KV heads (its split, or the one head its query heads use when replicated) and the query heads that
    read them."""
    if num_kv_heads >= tp.size:
        first_kv, kv_count = split(num_kv_heads, tp.size, tp.rank)
        group = num_heads // num_kv_heads
        return HeadShare(first_kv * group, kv_count * group, first_kv, kv_count)
    per_rank = num_heads // tp.size
    return HeadShare(tp.rank * per_rank, per_rank, tp.rank // (tp.size // num_kv_heads), 1)


def local_config(cfg, tp: TensorParallel):
    """A DecoderConfig with this rank's head and MLP counts (vocabulary and hidden size unchanged)."""
    if tp.size == 1:
        return cfg
    check_shareable(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp.size)
    heads = head_share(cfg.num_heads, cfg.num_kv_heads, tp)
    return dataclasses.replace(cfg, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads,
                               intermediate_size=split(cfg.intermediate_size, tp.size, tp.rank)[1])


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of this rank's vocabulary: ceil(V / N) rows each, the last rank fewer."""
    per_rank = -(-vocab_size // tp.size)
    start = tp.rank * per_rank
    size = min(vocab_size, start + per_rank) - start
    if size <= 0:
        raise ValueError(f"vocab_size={vocab_size} is too small for tensor_parallel_size={tp.size}")
    return start, size


def shard(module: str, leaf: str, full, tp: TensorParallel) -> tuple[int | None, int, int]:
    """(dim, start, size) of the checkpoint tensor `<module>.<leaf>` this rank keeps; dim None: all of it.
    full: the whole model's DecoderConfig."""
    d = full.head_dim
    heads = head_share(full.num_heads, full.num_kv_heads, tp)
    first_column, columns = split(full.intermediate_size, tp.size, tp.rank)
    if module == "q_proj":
        return 0, heads.first_head * d, heads.num_heads * d
    if module in ("k_proj", "v_proj"):
        return 0, heads.first_kv_head * d, heads.num_kv_heads * d
    if module in ("gate_proj", "up_proj"):
        return 0, first_column, columns
    if module == "o_proj" and leaf == "weight":
        return 1, heads.first_head * d, heads.num_heads * d
    if module == "down_proj" and leaf == "weight":
        return 1, first_column, columns
    if module in VOCAB_PARALLEL:
        return 0, *vocab_range(full.vocab_size, tp)
    return None, 0, 0
