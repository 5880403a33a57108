"""Host-side step planning: a scheduled step turned into a plain, picklable `StepPlan`.

The planner never touches the device: it reads sequences and block tables, decides which decode graph
(if any) runs the step and, for offload decode steps staged in a ring slot, the copies. A device
worker (engine/worker.py) executes the plan; the same plan could drive N workers (tensor parallelism).
Block locations are explicit: `block_tables` hold ids within their pool and `on_host` says which pool.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import HOST_BASE
from nanovllm.engine.offload.staged import COPIES_PER_LAYER, split_runs
from nanovllm.engine.offload.host_pool import consecutive_runs
from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.layers.sampler import RowHistory
from nanovllm.sampling_params import SamplingParams


STEP_KINDS = ("decode", "mixed", "prefill")  # rows that each sample their one new token (decode rows) alone, beside
# prefill rows, or prefill rows alone; the planner counts its plans by kind (`StepPlanner.steps`)


@dataclass(frozen=True)
class WorkerLimits:
    """What the planner must know of the worker: block size, decode graph buckets (None: no graphs),
    for offload decode steps staged in a ring slot the most host blocks (0: staging off) and the
    shortest copy in blocks, and the buckets of narrowed decode steps (engine/narrowed.py)."""

    block_size: int
    graph_buckets: list[int] | None = None
    offload: bool = False
    staged_max_blocks: int = 0
    min_copy_blocks: int = 1
    narrowed_buckets: list[int] | None = None  # batch sizes that run the block selector's narrowed decode steps


@dataclass
class PromptLogprobRows:
    """Hidden rows [row, row + len(targets)) of the step predict the prompt tokens `targets`."""

    seq_id: int
    row: int
    targets: list[int]
    top_n: int


@dataclass
class StepPlan:
    input_ids: list[int]  # -(r + 1): the token sampled in row r of the previous launched step, still on the device
    positions: list[int]
    slots: list[int]  # device KV slot (block * block_size + offset) of each new token
    query_lens: list[int]
    seq_lens: list[int]  # tokens of KV per sequence after the step
    block_tables: list[list[int]]  # per sequence, its blocks in position order, ids within their pool
    on_host: list[list[bool]] | None  # per sequence and block: in the host pool; None: every block on the device
    offloads: list[tuple[int, int]]  # (device block, host block) copies due before the step's first KV write
    sample_rows: list[int]  # the rows whose logits are sampled, one per sampling sequence ...
    sample_seq_ids: list[int]  # ... their sequences ...
    sample_params: list[SamplingParams]  # ... and sampling parameters
    sample_history: list[RowHistory | None] | None = None  # per sampling row, for penalties/min_tokens; None: no row has any
    seq_ids: list[int] = field(default_factory=list)  # the step's sequences, in batch order
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # finished sequences: the worker drops their state
    graph_batch: int | None = None  # the decode graph bucket that runs the step; None: eager
    staged_copies: list[tuple[int, int, int]] | None = None  # (host block, ring position, n) per layer: see offload/staged.py
    narrowed: bool = False  # every row narrowed by the block selector the same way: engine/narrowed.py
    # per sequence, its KV length once the tokens it is prefilling are all computed (the prompt's end, past
    # a chunk); None: each ends with this step (a decode step)
    prefill_ends: list[int] | None = None
    kind: int = 0  # index in STEP_KINDS

    @property
    def has_host_blocks(self) -> bool:
        return self.on_host is not None and any(any(t) for t in self.on_host)


class StepPlanner:
    def __init__(self, limits: WorkerLimits):
        self.limits = limits
        # (block_size, KV lengths) -> True when a decode step attends to every block (the block selector
        # says so on the host): only then can it run the dense decode graphs and stage copies for all layers
        self.dense_decode: Callable[[int, list[int]], bool] = lambda block_size, seq_lens: True
        # ... and when every row is narrowed alike (BlockSelector.narrowed_decode): the narrowed graphs
        self.narrowed_decode: Callable[[int, list[int]], bool] = lambda block_size, seq_lens: False
        self._last_rows: dict[int, int] = {}  # seq_id -> its row in the last launched step's sampled tokens
        self._released: list[int] = []
        self.steps = [0] * len(STEP_KINDS)  # plans made so far by kind

    def release(self, seq_id: int) -> None:
        self._released.append(seq_id)

    def plan(self, scheduled: list[ScheduledSeq], offloads: list[tuple[int, int]], launched: bool = False) -> StepPlan:
        """launched: the step's tokens stay on the device as inputs of the next step (async scheduling)."""
        seqs = [item.seq for item in scheduled]
        sampling = [item for item in scheduled if item.samples]
        if len(sampling) == len(scheduled) and all(item.num_new_tokens == 1 for item in scheduled):
            plan = self._decode_plan(seqs, offloads)
        else:
            plan = self._mixed_plan(scheduled, offloads)
            plan.kind = 1 if any(item.num_new_tokens == 1 for item in sampling) else 2
        self.steps[plan.kind] += 1
        plan.seq_ids = [s.seq_id for s in seqs]
        plan.sample_seq_ids = [item.seq.seq_id for item in sampling]
        plan.sample_params = [item.seq.params for item in sampling]
        if any(p.adjusts_logits for p in plan.sample_params):
            plan.sample_history = [_row_history(item.seq) for item in sampling]
        plan.released, self._released = self._released, []
        if launched:
            self._last_rows = {seq_id: i for i, seq_id in enumerate(plan.sample_seq_ids)}
        return plan

    def _decode_plan(self, seqs, offloads) -> StepPlan:
        bs = self.limits.block_size
        positions = [len(s) - 1 for s in seqs]
        ids = [s.token_ids[-1] for s in seqs]
        if PLACEHOLDER in ids:
            ids = [self._input_id(s.seq_id, t) for s, t in zip(seqs, ids)]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        plan = StepPlan(ids, positions, slots, [1] * len(seqs), [p + 1 for p in positions], [], None, list(offloads),
                        list(range(len(seqs))), [], [])
        self._locate_blocks(plan, [s.block_table for s in seqs])
        if not self.dense_decode(bs, plan.seq_lens):
            narrowed = self.limits.narrowed_buckets
            if narrowed and len(seqs) <= narrowed[-1] and self.narrowed_decode(bs, plan.seq_lens):
                plan.narrowed = True
                plan.graph_batch = next(size for size in narrowed if size >= len(seqs))
            return plan  # else selected per layer on the device, eagerly
        plan.staged_copies = self._staged_copies(plan)
        buckets = self.limits.graph_buckets
        host_ok = plan.staged_copies is not None or not (plan.has_host_blocks or offloads)
        if buckets and len(seqs) <= buckets[-1] and host_ok:
            plan.graph_batch = next(size for size in buckets if size >= len(seqs))
        return plan

    def _mixed_plan(self, scheduled: list[ScheduledSeq], offloads) -> StepPlan:
        bs = self.limits.block_size
        ids, positions, slots, query_lens, seq_lens, tables, rows = [], [], [], [], [], [], []
        prompt_rows = []
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            ids.extend(seq.token_ids[start : start + n])
            if ids[-1] == PLACEHOLDER:  # only ever a sequence's last token
                ids[-1] = self._input_id(seq.seq_id, PLACEHOLDER)
            positions.extend(range(start, start + n))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            end = min(start + n, seq.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
            if seq.params.prompt_logprobs is not None and end > start:
                prompt_rows.append(PromptLogprobRows(seq.seq_id, len(ids) - n, seq.token_ids[start + 1 : end + 1],
                                                     seq.params.prompt_logprobs))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            if item.samples:
                rows.append(len(ids) - 1)
        plan = StepPlan(ids, positions, slots, query_lens, seq_lens, [], None, list(offloads), rows, [], [],
                        prompt_logprobs=prompt_rows, prefill_ends=[len(item.seq) for item in scheduled])
        self._locate_blocks(plan, tables)
        return plan

    def _locate_blocks(self, plan: StepPlan, tables: list[list[int]]) -> None:
        """The step's blocks in position order (only those its KV covers), with explicit locations."""
        if not self.limits.offload:
            plan.block_tables = tables
            return
        bs = self.limits.block_size
        plan.block_tables, plan.on_host = [], []
        for table, n in zip(tables, plan.seq_lens):
            table = table[: -(-n // bs)]
            plan.block_tables.append([b - HOST_BASE if b >= HOST_BASE else b for b in table])
            plan.on_host.append([b >= HOST_BASE for b in table])

    def _staged_copies(self, plan: StepPlan) -> list[tuple[int, int, int]] | None:
        """A decode step's host blocks numbered 0, 1, ... as ring positions, cut into at most
        COPIES_PER_LAYER copies; None when staging is off or they do not fit (the step goes the split way)."""
        if not self.limits.staged_max_blocks:
            return None
        host_ids = [b for table, flags in zip(plan.block_tables, plan.on_host) for b, h in zip(table, flags) if h]
        if len(host_ids) > self.limits.staged_max_blocks:
            return None
        return split_runs(consecutive_runs(list(zip(host_ids, range(len(host_ids))))), COPIES_PER_LAYER,
                          self.limits.min_copy_blocks)

    def _input_id(self, seq_id: int, token: int) -> int:
        return token if token != PLACEHOLDER else -1 - self._last_rows[seq_id]


def _row_history(seq: Sequence) -> RowHistory | None:
    """What the sampler's logit adjustments need of seq (its tokens are all on the host: steps with
    penalties run synchronously)."""
    p = seq.params
    if not p.adjusts_logits:
        return None
    return RowHistory(seq.num_output_tokens, seq.prompt_token_ids if p.repetition_penalty != 1.0 else None,
                      seq.output_token_ids if p.penalizes else None, seq.min_tokens_stop_ids if p.min_tokens else [])
