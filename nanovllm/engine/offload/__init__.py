"""KV-cache CPU offload: a pinned host pool and the KV-access strategies for KV that lives partly in it.

- `host_pool`: the host pool, the GPU ring of staging slots, the copy streams and transfer counts;
- `split`: steps outside the decode graphs: one pass over a ring slot (`SinglePassKV`) or device
  blocks plus host pieces merged by log-sum-exp (`SplitKV`), copies planned per layer from the
  step's block selection;
- `staged`: decode steps whose host KV fits one ring slot, copied layer by layer inside the CUDA
  graphs (`StagedCopies`, `StagedKV`).

`offload_kv_access` picks the strategy for one step from its plan.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.offload.host_pool import HostKVPool
from nanovllm.engine.offload.split import SinglePassKV, SplitKV
from nanovllm.layers.attention import AttentionBackend
from nanovllm.layers.block_selector import BlockSelector, SparseStats

if TYPE_CHECKING:
    from nanovllm.engine.step_plan import StepPlan


def offload_kv_access(pool: HostKVPool, cache: PagedKVCache, backend: AttentionBackend, plan: StepPlan,
                      slots, selector: BlockSelector, stats: SparseStats | None = None) -> SinglePassKV | SplitKV:
    """A step with host blocks or device->host moves, outside the graphs. slots: the new tokens'
    device slots as a tensor. The caller calls begin() before the forward pass."""
    tables, flags = plan.block_tables, plan.on_host
    if selector.dense and sum(map(len, tables)) <= pool.ring_blocks:
        return SinglePassKV(pool, cache, backend, plan.offloads, tables, flags, plan.query_lens, plan.seq_lens, slots)
    return SplitKV(pool, cache, backend, plan.offloads, tables, flags, plan.query_lens, plan.seq_lens, plan.slots,
                   selector, stats, plan.prefill_ends)
