"""Scheduler + BlockManager without a model: a simulated engine loop checked by properties.

The simulation mirrors LLMEngine: admission (check_request), schedule -> "run the model" -> mark_computed,
then one sampled token for each item that samples and a "length" finish at max_tokens or max_model_len.
The "model" writes a shadow KV cache: each slot records the identity of the token prefix whose KV it
holds, so a wrong prefix-cache hit, a write into a shared or cached block, or a block handed to two
sequences shows up as wrong KV when a token is sampled.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.block_manager import HOST_BASE, NO_HASH, BlockManager, is_host_block
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BS = 16
VOCAB = 3


def admissible(block_manager: BlockManager, max_model_len: int, n_prompt: int, max_tokens: int) -> bool:
    """Mirror of LLMEngine.check_request (the parts that depend on lengths)."""
    if n_prompt == 0 or n_prompt + 1 > max_model_len:
        return False
    kv_tokens = min(n_prompt + max_tokens, max_model_len) - 1
    return block_manager.blocks_for_tokens(kv_tokens) <= block_manager.num_blocks + block_manager.num_host_blocks


class Sim:
    def __init__(self, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 enable_prefix_caching: bool = True, seed: int = 0, block_size: int = BS, num_host_blocks: int = 0):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching, num_host_blocks)
        config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=max_model_len)
        self.sched = Scheduler(config, self.bm)
        self.bs = block_size
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host_kv: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.num_offloaded = 0
        self.ident: dict[int, list[int]] = {}  # seq_id -> identity of token_ids[:p+1] for each p
        self.live: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.aborted: list[Sequence] = []
        self.admitted: list[Sequence] = []
        self.steps = 0
        self.max_step_tokens = 0
        self.num_cache_hit_tokens = 0

    # ---- requests --------------------------------------------------------------------------
    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        assert admissible(self.bm, self.max_model_len, len(prompt), max_tokens)
        seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens), self.bs)
        self.ident[seq.seq_id] = []
        self._extend_ident(seq)
        self.sched.add(seq)
        self.live.append(seq)
        self.admitted.append(seq)
        self.check()
        return seq

    def abort(self, seq: Sequence) -> None:
        self.sched.finish(seq, "abort")
        assert seq.is_finished and seq.finish_reason == "abort" and seq.block_table == []
        self.live.remove(seq)
        self.aborted.append(seq)
        self.sched.finish(seq, "abort")  # a second finish is a no-op
        self.check()

    def _extend_ident(self, seq: Sequence) -> None:
        ids = self.ident[seq.seq_id]
        for p in range(len(ids), len(seq)):
            ids.append(hash((ids[-1] if ids else None, seq.token_ids[p])))

    def verify_kv(self, seq: Sequence, upto: int) -> None:
        """The KV of positions [0, upto) that seq's block table points at is seq's own prefix."""
        ids = self.ident[seq.seq_id]
        for p in range(upto):
            block = seq.block_table[p // self.bs]
            got = (self.host_kv[block - HOST_BASE] if is_host_block(block) else self.kv[block])[p % self.bs]
            assert got == ids[p], f"seq {seq.seq_id}: wrong KV at position {p}"

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list:
        sched, bm = self.sched, self.bm
        pending = sched.has_unfinished()
        was_waiting = {s.seq_id for s in sched.waiting}
        scheduled = sched.schedule()
        self.steps += 1
        for device_block, host_block in bm.take_pending_offloads():  # the runner copies these before any read
            self.host_kv[host_block] = list(self.kv[device_block])
            self.num_offloaded += 1
        if pending:
            assert scheduled, "stall: requests pending but nothing scheduled"
        else:
            assert not scheduled
        total = sum(item.num_new_tokens for item in scheduled)
        assert total <= sched.max_num_batched_tokens
        self.max_step_tokens = max(self.max_step_tokens, total)
        ids = [item.seq.seq_id for item in scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        assert len(sched.running) <= sched.max_num_seqs
        running_ids = {s.seq_id for s in sched.running}
        for item in scheduled:
            seq = item.seq
            assert seq.seq_id in running_ids and seq.status == SequenceStatus.RUNNING
            assert item.num_new_tokens >= 1
            assert seq.num_computed_tokens + item.num_new_tokens <= len(seq)
            assert len(seq.block_table) * self.bs >= seq.num_computed_tokens + item.num_new_tokens
            if seq.seq_id in was_waiting:  # admitted this step: the computed part is a prefix-cache hit
                assert seq.num_computed_tokens == seq.num_cached_tokens
                assert seq.num_cached_tokens % self.bs == 0 and seq.num_cached_tokens < len(seq)
                if not bm.enable_prefix_caching:
                    assert seq.num_cached_tokens == 0
                self.num_cache_hit_tokens += seq.num_cached_tokens
                self.verify_kv(seq, seq.num_computed_tokens)
        self.check(after_schedule=True)

        samples = [item.samples for item in scheduled]  # read before mark_computed, as the runner does
        for item in scheduled:  # the "model" writes KV for the new tokens
            seq, ids_ = item.seq, self.ident[item.seq.seq_id]
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens):
                block = seq.block_table[p // self.bs]
                assert not is_host_block(block), "new KV must go to a device block"
                assert bm.ref_count[block] == 1, f"write into shared block {block}"
                assert bm.block_hash[block] == NO_HASH, f"write into cached (hashed) block {block}"
                self.kv[block][p % self.bs] = ids_[p]
        sched.mark_computed(scheduled)
        for item, sampled in zip(scheduled, samples):
            seq = item.seq
            if not sampled:
                assert seq.num_computed_tokens < len(seq)
                continue
            assert seq.num_computed_tokens == len(seq)
            self.verify_kv(seq, len(seq))  # attention reads the whole prefix
            seq.append_token(self.rng.randrange(VOCAB))
            self._extend_ident(seq)
            if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
                sched.finish(seq, "length")
                assert seq.is_finished and seq.block_table == []
                self.live.remove(seq)
                self.finished.append(seq)
        self.check()
        return scheduled

    def check(self, after_schedule: bool = False) -> None:
        sched, bm = self.sched, self.bm
        bm.check_invariants(sched.running)
        assert len(sched.running) <= sched.max_num_seqs
        running, waiting = {s.seq_id for s in sched.running}, {s.seq_id for s in sched.waiting}
        assert not running & waiting
        assert running | waiting == {s.seq_id for s in self.live}
        assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
        for seq in sched.waiting:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in sched.running:
            assert seq.status == SequenceStatus.RUNNING
            assert seq.num_computed_tokens <= len(seq)
            assert len(seq.block_table) * self.bs >= seq.num_computed_tokens
            if not after_schedule:  # between steps: exactly the blocks its computed KV needs
                assert seq.num_computed_tokens < len(seq)
                assert len(seq.block_table) == bm.blocks_for_tokens(seq.num_computed_tokens)
        for seq in self.finished + self.aborted:
            assert seq.is_finished and seq.block_table == []
        assert sched.has_unfinished() == bool(self.live)

    def drain(self, max_steps: int = 20_000) -> None:
        while self.sched.has_unfinished():
            assert self.steps < max_steps, f"not finished after {max_steps} steps"
            self.step()
        self.check_done()

    def check_done(self) -> None:
        assert not self.live and not self.sched.running and not self.sched.waiting
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_used_host_blocks == 0
        self.bm.check_invariants([])
        for seq in self.admitted:
            assert seq.is_finished
            if seq in self.aborted:
                assert seq.finish_reason == "abort"
                continue
            assert seq.finish_reason == "length"
            assert seq.num_output_tokens >= 1
            assert seq.num_output_tokens == seq.params.max_tokens or len(seq) == self.max_model_len
            assert seq.num_output_tokens <= seq.params.max_tokens and len(seq) <= self.max_model_len
            assert seq.token_ids[: seq.num_prompt_tokens] == seq.prompt_token_ids


# ---- property test -----------------------------------------------------------------------------
@st.composite
def request(draw, sim: Sim):
    """A prompt (often sharing a block-aligned prefix with an earlier sequence, outputs included) and
    max_tokens, trimmed so that the engine's admission rule accepts it."""
    base: list[int] = []
    if sim.admitted and draw(st.integers(0, 3)):  # three times in four, reuse an earlier sequence's prefix
        src = draw(st.sampled_from(sim.admitted)).token_ids
        aligned = [k * sim.bs + d for k in range(1, len(src) // sim.bs + 1) for d in (-1, 0, 1)]
        cut = draw(st.one_of(st.sampled_from(aligned), st.integers(0, len(src))) if aligned
                   else st.integers(0, len(src)))
        base = list(src[: max(cut, 0)])
    tail = draw(st.one_of(st.just([]), st.lists(st.integers(0, VOCAB - 1), max_size=300)) if base
                else st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=300))
    prompt = (base + tail)[:300]
    max_tokens = draw(st.integers(1, 50))
    cap = (sim.bm.num_blocks + sim.bm.num_host_blocks) * sim.bs  # KV tokens that fit the whole pool
    prompt = prompt[: min(len(prompt), sim.max_model_len - 1, cap)]
    if min(len(prompt) + max_tokens, sim.max_model_len) - 1 > cap:
        max_tokens = cap + 1 - len(prompt)
    return prompt, max_tokens


def run_random_operations(sim: Sim, data) -> None:
    sim.check()
    num_ops = data.draw(st.integers(0, 40), label="num_ops")
    for _ in range(num_ops):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]), label="op")
        if op == "add":
            for _ in range(data.draw(st.integers(1, 4), label="adds")):
                prompt, max_tokens = data.draw(request(sim), label="request")
                sim.add(prompt, max_tokens)
        elif op == "step":
            for _ in range(data.draw(st.integers(1, 8), label="steps")):
                sim.step()
        elif sim.live:
            sim.abort(data.draw(st.sampled_from(sim.live), label="abort"))
    sim.drain()


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=250, **SETTINGS)
@given(
    num_blocks=st.integers(4, 40),
    max_num_batched_tokens=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    max_model_len=st.integers(2, 320),
    enable_prefix_caching=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_random_operations_keep_invariants_and_finish(num_blocks, max_num_batched_tokens, max_num_seqs,
                                                      max_model_len, enable_prefix_caching, seed, data):
    sim = Sim(num_blocks, max_num_batched_tokens, max_num_seqs, max_model_len, enable_prefix_caching, seed)
    run_random_operations(sim, data)


@settings(max_examples=150, **SETTINGS)
@given(
    num_blocks=st.integers(4, 12),
    max_num_batched_tokens=st.integers(8, 64),
    max_num_seqs=st.integers(2, 8),
    max_model_len=st.integers(48, 320),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_random_operations_tight_pool_with_prefix_caching(num_blocks, max_num_batched_tokens, max_num_seqs,
                                                          max_model_len, seed, data):
    """Small pools, several sequences and shared prefixes: preemption and cache hits/evictions are common."""
    sim = Sim(num_blocks, max_num_batched_tokens, max_num_seqs, max_model_len, True, seed)
    run_random_operations(sim, data)


# ---- deterministic tests -----------------------------------------------------------------------
@settings(max_examples=200, **SETTINGS)
@given(
    num_blocks=st.integers(1, 12),
    num_host_blocks=st.integers(0, 30),
    max_num_batched_tokens=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    max_model_len=st.integers(2, 320),
    enable_prefix_caching=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_random_operations_with_a_host_pool(num_blocks, num_host_blocks, max_num_batched_tokens, max_num_seqs,
                                            max_model_len, enable_prefix_caching, seed, data):
    """CPU offload: tiny device pools force blocks to the host and back; host exhaustion preempts; prefix
    hits (device blocks only) mix with blocks moving out."""
    sim = Sim(num_blocks, max_num_batched_tokens, max_num_seqs, max_model_len, enable_prefix_caching, seed,
              num_host_blocks=num_host_blocks)
    run_random_operations(sim, data)


def test_offload_moves_blocks_to_the_host_instead_of_preempting():
    sim = Sim(num_blocks=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=400,
              enable_prefix_caching=False, num_host_blocks=40)
    for n in (150, 90, 60):
        sim.add([1] * n, max_tokens=20)
    sim.drain()
    assert sim.num_offloaded > 10 and sim.sched.num_preemptions == 0


def test_prefix_hits_and_offload_in_one_run():
    sim = Sim(num_blocks=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=400,
              enable_prefix_caching=True, num_host_blocks=40)
    shared = [1, 2] * 40  # five full blocks
    for tail in ([0] * 90, [2] * 5, [1] * 60, [0, 1] * 3):
        sim.add(shared + tail, max_tokens=15)
    sim.drain()
    assert sim.num_offloaded > 5 and sim.num_cache_hit_tokens >= 2 * BS


def test_full_host_pool_preempts_and_resumes():
    sim = Sim(num_blocks=3, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=400,
              enable_prefix_caching=False, num_host_blocks=8)
    for n in (100, 100, 100):
        sim.add([2] * n, max_tokens=30)
    sim.drain()
    assert sim.num_offloaded > 0 and sim.sched.num_preemptions > 0


def test_preemption_happens_and_preempted_sequences_finish():
    sim = Sim(num_blocks=8, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024)
    seqs = [sim.add([i % VOCAB] + [(i + j) % VOCAB for j in range(39)], max_tokens=60) for i in range(4)]
    sim.drain(max_steps=5_000)
    assert sim.sched.num_preemptions > 0
    preempted = [s for s in seqs if s.num_preemptions > 0]
    assert preempted
    assert sum(s.num_preemptions for s in seqs) == sim.sched.num_preemptions
    for s in seqs:
        assert s.finish_reason == "length" and s.num_output_tokens == 60
    # the oldest request is never the victim: preemption takes the most recently admitted one
    assert seqs[0].num_preemptions == 0


def test_preempted_sequence_goes_to_the_front_of_the_queue():
    sim = Sim(num_blocks=4, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024)
    a = sim.add([0] * 31, max_tokens=30)  # grows to 60 KV tokens = 4 blocks
    b = sim.add([1] * 31, max_tokens=30)
    c = sim.add([2] * 5, max_tokens=5)
    for _ in range(200):
        sim.step()
        assert not a.is_finished
        if b.num_preemptions:
            break
    assert b.num_preemptions == 1
    assert sim.sched.waiting[0] is b and b.block_table == [] and b.num_computed_tokens == 0
    assert a.num_preemptions == 0
    sim.drain()
    assert all(s.finish_reason == "length" for s in (a, b, c))


@pytest.mark.parametrize("budget", [1, 7, 16, 63, 64])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_request_at_the_length_limit_gets_exactly_one_token(budget, prefix_caching):
    max_model_len = 64
    sim = Sim(num_blocks=4, max_num_batched_tokens=budget, max_num_seqs=2, max_model_len=max_model_len,
              enable_prefix_caching=prefix_caching)
    prompt = [t % VOCAB for t in range(max_model_len - 1)]
    assert admissible(sim.bm, max_model_len, len(prompt), 10_000)
    assert not admissible(sim.bm, max_model_len, max_model_len, 1)  # one more prompt token is refused
    a = sim.add(prompt, max_tokens=10_000)
    sim.drain(max_steps=200)
    assert a.finish_reason == "length" and a.num_output_tokens == 1 and len(a) == max_model_len
    assert sim.steps == -(-len(prompt) // budget)
    # the same prompt again: a prefix-cache hit on all full blocks but the one holding the last token
    b = sim.add(prompt, max_tokens=10_000)
    sim.drain(max_steps=400)
    assert b.finish_reason == "length" and b.num_output_tokens == 1
    assert b.num_cached_tokens == (48 if prefix_caching else 0)


def test_chunked_prefill_samples_only_on_the_last_chunk():
    sim = Sim(num_blocks=16, max_num_batched_tokens=30, max_num_seqs=4, max_model_len=1024)
    seq = sim.add([1] * 100, max_tokens=3)
    chunks = []
    while seq.num_output_tokens == 0:
        (item,) = sim.step()
        chunks.append(item.num_new_tokens)
    assert chunks == [30, 30, 30, 10]
    sim.drain()
    assert seq.num_output_tokens == 3 and sim.steps == 6


def test_budget_is_shared_decodes_first_then_new_prefills():
    sim = Sim(num_blocks=40, max_num_batched_tokens=20, max_num_seqs=8, max_model_len=1024)
    a = sim.add([0] * 10, max_tokens=20)
    sim.step()  # a's prefill (10 tokens)
    b = sim.add([1] * 50, max_tokens=5)
    scheduled = sim.step()
    assert [(i.seq, i.num_new_tokens) for i in scheduled] == [(a, 1), (b, 19)]
    scheduled = sim.step()
    assert [(i.seq, i.num_new_tokens) for i in scheduled] == [(a, 1), (b, 19)]
    sim.drain()


def test_max_num_seqs_limits_running():
    sim = Sim(num_blocks=40, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=1024)
    seqs = [sim.add([i % VOCAB] * 4, max_tokens=5) for i in range(5)]
    sim.step()
    assert sim.sched.running == seqs[:2] and list(sim.sched.waiting) == seqs[2:]
    sim.drain()
    assert all(s.num_output_tokens == 5 for s in seqs)


def test_prefix_cache_hit_through_the_scheduler():
    sim = Sim(num_blocks=20, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024)
    prompt = [t % VOCAB for t in range(70)]
    a = sim.add(prompt, max_tokens=2)
    sim.drain()
    b = sim.add(prompt, max_tokens=2)
    (item,) = sim.step()
    assert b.num_cached_tokens == 64 and item.num_new_tokens == 6
    # a request extending a's full output also hits a's generated-token blocks (none full here)
    c = sim.add(a.token_ids + [0] * 20, max_tokens=1)
    sim.drain()
    assert c.num_cached_tokens == 64
    assert sim.num_cache_hit_tokens == 128


def test_abort_waiting_and_running_frees_blocks():
    sim = Sim(num_blocks=8, max_num_batched_tokens=32, max_num_seqs=1, max_model_len=1024)
    a = sim.add([0] * 40, max_tokens=50)
    b = sim.add([1] * 40, max_tokens=50)
    sim.step()
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    assert sim.bm.num_used_blocks == 2
    sim.abort(b)
    sim.abort(a)
    assert sim.bm.num_free_blocks == 8 and not sim.sched.has_unfinished()
    assert sim.step() == []
    sim.check_done()


def test_admission_mirror_matches_engine_check_request():
    from nanovllm.engine.llm_engine import LLMEngine

    for num_blocks in (1, 3):
        bm = BlockManager(num_blocks, BS)
        for limit in (1, 2, 16, 17, 48, 49, 100):
            engine = SimpleNamespace(config=SimpleNamespace(max_model_len=limit, hf_config={"vocab_size": VOCAB}),
                                     block_manager=bm)
            for n in range(1, 60, 3):
                for max_tokens in (1, 2, 15, 16, 17, 40, 1000):
                    try:
                        LLMEngine.check_request(engine, [0] * n, SamplingParams(max_tokens=max_tokens))
                        accepted = True
                    except ValueError:
                        accepted = False
                    assert accepted == admissible(bm, limit, n, max_tokens), (num_blocks, limit, n, max_tokens)


def test_offload_of_a_block_freed_in_the_same_step_is_dropped():
    """A host block freed before its copy ran may be handed out again: only the live copy must remain."""
    bm = BlockManager(4, BS, enable_prefix_caching=False, num_host_blocks=1)
    a, b = (Sequence([1] * 2 * BS, SamplingParams(), BS) for _ in range(2))
    bm.admit(a, [], 2 * BS)
    a.num_computed_tokens = 2 * BS
    assert bm.offload_blocks(1, [a]) == 1
    bm.free(a)
    bm.admit(b, [], 2 * BS)
    b.num_computed_tokens = 2 * BS
    moved = b.block_table[1]  # the latest full block goes first
    assert bm.offload_blocks(1, [b]) == 1
    assert bm.take_pending_offloads() == [(moved, 0)]
    assert b.block_table[1] == HOST_BASE


def test_offload_takes_decoding_sequences_blocks_before_the_prefilling_ones():
    """A prefill that needs room moves the other (decoding) sequences' blocks to the host first: they
    read them back with one query per step, where the prefill would attend over them with a whole chunk."""
    bm = BlockManager(12, BS, True, 32)
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=4 * BS, max_model_len=1024)
    scheduler = Scheduler(config, bm)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first, second = (Sequence([1] * (8 * BS), params, BS), Sequence([2] * (8 * BS), params, BS))
    for seq in (first, second):
        scheduler.add(seq)
    while second.num_computed_tokens < second.num_prompt_tokens:
        scheduled = scheduler.schedule()
        bm.take_pending_offloads()
        scheduler.mark_computed(scheduled)
        for item in scheduled:
            if item.samples:
                item.seq.append_token(0)
    assert not any(is_host_block(b) for b in second.block_table)  # the prefill kept its KV on the device
    assert sum(is_host_block(b) for b in first.block_table) >= 4
