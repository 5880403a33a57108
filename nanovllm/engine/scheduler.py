"""Continuous batching with chunked prefill, prefix-cache admission and preemption by recompute.

Every step gets a token budget (max_num_batched_tokens). Running sequences are served first, in
arrival order: a decode costs one token, an unfinished prefill takes the next chunk that fits.
Waiting sequences are then admitted while budget, sequence slots and KV blocks last. When a running
sequence needs a block and none is free, the most recently admitted running sequence is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later. With a host
(CPU offload) pool, computed device blocks move to the host first and a chunk may shrink to the room
left; preemption happens only when the host pool is full as well.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    # True when this step computes the sequence's last token, so its logits give the next one; fixed
    # when scheduled (marking the step computed, or a placeholder appended, would change the answer).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitted: list[Sequence] = []  # taken from the waiting queue by the latest schedule()
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_forks(self, seqs: list[Sequence]) -> None:
        """Samples of a running request (n > 1), queued first: they share its prompt's blocks."""
        self.waiting.extendleft(reversed(seqs))

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        self.admitted = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.token_ids[-1] == PLACEHOLDER and self._ends_by_length(seq):  # async: its pending token is its last
                i += 1
                continue
            n = self._reserve(seq, min(seq.num_uncomputed_tokens, budget))
            if n == 0:  # no room even after offloading: free the newest sequence, then retry
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                continue
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        if preempted:
            return scheduled
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self._cached_prefix(seq)
            cached = len(prefix) * self.block_manager.block_size
            n = min(len(seq) - cached, budget)
            if self.block_manager.num_host_blocks and not self.block_manager.can_admit(prefix, cached + n):
                # Making room moves blocks out, which may be the very prefix blocks: start cold instead.
                prefix, cached = [], 0
                n = self._make_room(None, min(len(seq), budget))
            if n == 0 or not self.block_manager.can_admit(prefix, cached + n):
                break
            self.block_manager.admit(seq, prefix, cached + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.admitted.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks seq can start from: its parent's prompt blocks (another sample of the same request), else
        the prefix cache's. Prompt logprobs need logits at every prompt position: such requests skip both."""
        if seq.params.prompt_logprobs is not None:
            return []
        forked = self.block_manager.fork_prefix(seq.parent, seq.num_prompt_tokens) if seq.parent is not None else []
        return forked or self.block_manager.match_prefix(seq.token_ids)

    def _ends_by_length(self, seq: Sequence) -> bool:
        return seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len

    def _reserve(self, seq: Sequence, n: int) -> int:
        """Give seq KV blocks for its next n tokens, or for as many as fit after offloading; returns
        how many tokens it got blocks for (0: none)."""
        bm = self.block_manager
        if seq.num_computed_tokens + n <= len(seq.block_table) * bm.block_size:  # its blocks hold them already
            return n
        if not bm.can_grow(seq, seq.num_computed_tokens + n):
            if not bm.num_host_blocks:
                return 0
            n = self._make_room(seq, n)
            if n == 0 or not bm.can_grow(seq, seq.num_computed_tokens + n):
                return 0
        bm.grow(seq, seq.num_computed_tokens + n)
        return n

    def _make_room(self, seq: Sequence | None, n: int) -> int:
        """Offload computed blocks (the newest other running sequences' first, then seq's own) until
        the device pool can take n more tokens of seq (None: a new sequence); returns the tokens that
        fit afterwards, at most n. Others first: every step reads a sequence's host blocks again, and a
        decoding sequence reads them with one query where a prefilling seq would attend over them with
        a whole chunk through the slower history path."""
        bm = self.block_manager
        computed, held = (seq.num_computed_tokens, len(seq.block_table)) if seq else (0, 0)
        missing = bm.blocks_for_tokens(computed + n) - held - bm.num_free_blocks
        if missing > 0:
            newest_first = [s for s in reversed(self.running) if s is not seq]
            bm.offload_blocks(missing, newest_first + ([seq] if seq else []))
        room = (held + bm.num_free_blocks) * bm.block_size - computed
        return max(0, min(n, room))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def mark_computed(self, scheduled: list[ScheduledSeq], register: bool = True) -> None:
        """Advance the computed counts; register: also hash newly full blocks for prefix caching (not
        while a block may still hold a PLACEHOLDER: the engine registers those when tokens arrive)."""
        bs = self.block_manager.block_size
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if register and seq.num_computed_tokens // bs > (seq.num_computed_tokens - item.num_new_tokens) // bs:
                self.block_manager.register_computed_blocks(seq)  # a block became full

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove seq from the queues, free its blocks and mark it finished."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        seq.finish(reason)
