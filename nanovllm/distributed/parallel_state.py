"""Which rank of how many this process is, and the collectives the parallel layers need.

Rank 0 is the engine's own process (the driver); ranks 1..N-1 are worker processes. Collectives go
through the default process group (gloo on the CPU, NCCL on CUDA); `control` is a gloo group for small
host-side exchanges (KV block counts). With size 1 nothing here is ever called.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


SINGLE = TensorParallel()
_control_group: dist.ProcessGroup | None = None


def init_group(tp: TensorParallel, backend: str, init_method: str) -> None:
    """Join the default process group, and on NCCL also a gloo group for host-side exchanges."""
    global _control_group
    dist.init_process_group(backend, init_method=init_method, rank=tp.rank, world_size=tp.size)
    _control_group = dist.new_group(backend="gloo") if backend != "gloo" else None


def destroy_group() -> None:
    global _control_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def gather_to_driver(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """[T, n] pieces of every rank concatenated along the last dimension on rank 0; other ranks get x back."""
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.is_driver else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if tp.is_driver else x


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_control_group)
    return int(t.item())
