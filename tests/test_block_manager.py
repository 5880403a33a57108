"""Unit tests of the paged KV block allocator: counts, reference counts and hash-chained prefix caching."""
from __future__ import annotations

import pytest

from nanovllm.engine import block_manager as bm_module
from nanovllm.engine.block_manager import NO_HASH, BlockManager, chain_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 16


def make_seq(tokens: list[int], block_size: int = BS) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=8), block_size)


def admit_computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """Admit a sequence reusing whatever prefix is cached, and 'compute' its whole prompt."""
    seq = make_seq(tokens, bm.block_size)
    prefix = bm.match_prefix(seq.token_ids)
    assert bm.can_admit(prefix, len(seq))
    bm.admit(seq, prefix, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.register_computed_blocks(seq)
    return seq


def toks(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 97 for i in range(n)]


# ---- counts ----------------------------------------------------------------------------------
def test_fresh_pool_is_all_free():
    bm = BlockManager(10, BS)
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    bm.check_invariants([])


@pytest.mark.parametrize("n,blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_tokens(n, blocks):
    assert BlockManager(4, BS).blocks_for_tokens(n) == blocks


def test_admit_grow_free_counts():
    bm = BlockManager(10, BS)
    seq = make_seq(toks(40))
    bm.admit(seq, [], 10)  # first prefill chunk: 10 tokens -> 1 block
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 9
    assert seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0
    bm.check_invariants([seq])
    assert bm.can_grow(seq, 40)
    bm.grow(seq, 40)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    bm.grow(seq, 33)  # already covered: no-op
    assert len(seq.block_table) == 3
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 10
    bm.free(seq)  # freeing an empty table again is harmless
    assert bm.num_free_blocks == 10
    bm.check_invariants([])


def test_grow_refuses_beyond_pool():
    bm = BlockManager(3, BS)
    seq = make_seq(toks(100))
    bm.admit(seq, [], 48)
    assert bm.num_free_blocks == 0
    assert bm.can_grow(seq, 48) and not bm.can_grow(seq, 49)
    with pytest.raises(RuntimeError, match="KV pool exhausted"):
        bm.grow(seq, 49)
    bm.check_invariants([seq])


def test_admit_rejects_sequence_that_already_holds_blocks():
    bm = BlockManager(4, BS)
    seq = make_seq(toks(5))
    bm.admit(seq, [], 5)
    with pytest.raises(AssertionError):
        bm.admit(seq, [], 5)


def test_block_ids_are_distinct_across_sequences():
    bm = BlockManager(8, BS)
    seqs = [admit_computed(bm, toks(20, start=10 * i)) for i in range(4)]
    ids = [b for s in seqs for b in s.block_table]
    assert len(ids) == len(set(ids)) == 8 and bm.num_free_blocks == 0
    bm.check_invariants(seqs)


# ---- prefix caching --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65])
def test_same_prompt_hits_full_blocks_of_all_but_last_token(n):
    bm = BlockManager(16, BS)
    prompt = toks(n)
    a = admit_computed(bm, prompt)
    expected = (n - 1) // BS  # full blocks inside tokens[:n-1]; the last token is always recomputed
    hit = bm.match_prefix(prompt)
    assert hit == a.block_table[:expected]
    b = make_seq(prompt)
    bm.admit(b, hit, n)
    assert b.num_cached_tokens == b.num_computed_tokens == expected * BS
    assert b.num_uncomputed_tokens >= 1
    assert b.block_table[:expected] == a.block_table[:expected]
    assert not set(b.block_table[expected:]) & set(a.block_table)
    for blk in hit:
        assert bm.ref_count[blk] == 2
    bm.check_invariants([a, b])


def test_longer_prompt_with_cached_prefix_hits_all_matching_full_blocks():
    bm = BlockManager(16, BS)
    a = admit_computed(bm, toks(48))  # 3 full blocks registered
    assert bm.match_prefix(toks(48) + [1, 2, 3]) == a.block_table  # all three: the last token is past them
    assert bm.match_prefix(toks(48) + [1]) == a.block_table
    assert bm.match_prefix(toks(40)) == a.block_table[:2]
    # diverging inside block 2 keeps blocks 0 and 1
    assert bm.match_prefix(toks(40) + [999] * 20) == a.block_table[:2]
    # diverging in block 0 hits nothing, even though later blocks are identical (hashes chain)
    assert bm.match_prefix([999] + toks(60)[1:]) == []


def test_same_block_content_after_a_different_prefix_is_not_a_hit():
    bm = BlockManager(16, BS)
    x, y, z = [1] * BS, [2] * BS, [3] * BS
    admit_computed(bm, x + y + [0])
    assert len(bm.match_prefix(x + y + [5])) == 2
    assert bm.match_prefix(z + y + [5]) == []  # block "y" is cached, but after "x", not after "z"
    assert len(bm.match_prefix(x + z + [5])) == 1


def test_only_computed_full_blocks_are_matchable():
    bm = BlockManager(16, BS)
    prompt = toks(70)
    a = make_seq(prompt)
    bm.admit(a, [], 40)  # chunk of 40 scheduled, nothing computed yet
    bm.register_computed_blocks(a)
    assert bm.match_prefix(prompt) == []
    a.num_computed_tokens = 40  # 2 full blocks + 8 tokens computed
    bm.register_computed_blocks(a)
    assert bm.match_prefix(prompt) == a.block_table[:2]
    bm.grow(a, 70)
    a.num_computed_tokens = 70
    bm.register_computed_blocks(a)
    bm.register_computed_blocks(a)  # idempotent
    assert bm.match_prefix(prompt) == a.block_table[:4]
    assert sum(1 for h in bm.block_hash if h != NO_HASH) == 4
    bm.check_invariants([a])


def test_generated_tokens_are_cached_too():
    bm = BlockManager(16, BS)
    a = admit_computed(bm, toks(20))
    for t in range(12):  # decode 12 tokens: the sequence now has 32 tokens, 31 of them computed
        a.append_token(500 + t)
        bm.grow(a, len(a))
        a.num_computed_tokens = len(a) - 1 if t == 11 else len(a)
        bm.register_computed_blocks(a)
    assert len(a) == 32 and a.num_computed_tokens == 31
    assert bm.match_prefix(a.token_ids + [7]) == a.block_table[:1]  # block 1 not fully computed yet
    a.num_computed_tokens = 32
    bm.register_computed_blocks(a)
    assert bm.match_prefix(a.token_ids + [7]) == a.block_table[:2]


def test_freed_blocks_stay_matchable_until_reused():
    bm = BlockManager(8, BS)
    prompt = toks(50)
    a = admit_computed(bm, prompt)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert bm.match_prefix(prompt) == table[:3]
    # admitting a matching sequence takes those blocks out of the free list
    b = make_seq(prompt)
    hit = bm.match_prefix(prompt)
    bm.admit(b, hit, len(b))
    assert b.block_table[:3] == table[:3] and b.num_cached_tokens == 48
    assert all(bm.ref_count[blk] == 1 for blk in b.block_table)
    assert bm.num_free_blocks == 8 - len(b.block_table)
    bm.check_invariants([b])


def test_evicted_blocks_are_no_longer_matched_and_tail_goes_first():
    bm = BlockManager(4, BS)
    prompt = toks(49)  # 4 blocks; 3 full blocks hashed (the 4th holds one token)
    a = admit_computed(bm, prompt)
    table = list(a.block_table)
    bm.free(a)
    assert bm.match_prefix(prompt) == table[:3]
    # Freed tail-first, so reuse evicts the tail first and the shared head lives longest.
    other = make_seq([900] * 64)
    bm.admit(other, [], 1)  # takes the partial 4th block (unhashed)
    assert bm.match_prefix(prompt) == table[:3]
    bm.grow(other, 17)  # takes block 2 of the prompt
    assert bm.match_prefix(prompt) == table[:2]
    bm.grow(other, 33)  # takes block 1
    assert bm.match_prefix(prompt) == table[:1]
    bm.grow(other, 49)  # takes block 0
    assert bm.match_prefix(prompt) == []
    assert set(other.block_table) == set(table)
    assert all(h == NO_HASH for h in bm.block_hash) and bm.hash_to_block == {}
    bm.check_invariants([other])
    # the reused blocks now hold other's content, which is matchable once computed
    other.num_computed_tokens = 49
    bm.register_computed_blocks(other)
    assert bm.match_prefix([900] * 64) == other.block_table[:3]
    assert bm.match_prefix(prompt) == []


def test_ref_counts_with_shared_prefix():
    bm = BlockManager(12, BS)
    base = toks(40)
    a = admit_computed(bm, base + [1] * 9)  # 49 tokens: blocks 0..2 full
    b = admit_computed(bm, base + [2] * 9)  # shares blocks 0,1 (block 2 differs)
    c = admit_computed(bm, base + [1] * 9)  # shares blocks 0,1,2 with a
    shared2, shared3 = a.block_table[:2], a.block_table[2]
    assert b.block_table[:2] == shared2 and c.block_table[:3] == a.block_table[:3]
    assert [bm.ref_count[x] for x in shared2] == [3, 3] and bm.ref_count[shared3] == 2
    bm.check_invariants([a, b, c])
    used = len({x for s in (a, b, c) for x in s.block_table})
    assert bm.num_used_blocks == used
    bm.free(a)
    assert [bm.ref_count[x] for x in shared2] == [2, 2] and bm.ref_count[shared3] == 1
    assert not set(shared2) & set(bm.free_blocks)
    bm.check_invariants([b, c])
    bm.free(c)
    assert shared3 in bm.free_blocks and [bm.ref_count[x] for x in shared2] == [1, 1]
    bm.check_invariants([b])
    bm.free(b)
    assert bm.num_free_blocks == 12
    bm.check_invariants([])


def test_can_admit_counts_free_cached_blocks_as_taken():
    bm = BlockManager(4, BS)
    prompt = toks(33)
    a = admit_computed(bm, prompt)  # 3 blocks, 2 full hashed
    bm.free(a)
    hit = bm.match_prefix(toks(64))
    assert len(hit) == 2
    # 4 free blocks: 2 come from the cache and 2 are fresh -> 64 tokens fit, 65 do not
    assert bm.can_admit(hit, 64)
    assert not bm.can_admit(hit, 65)
    # while another sequence holds one block, only 3 are free
    other = make_seq([900] * 5)
    bm.admit(other, [], 5)
    hit = bm.match_prefix(toks(64))
    assert len(hit) == 2  # the fresh block came from the unhashed tail, the cache survived
    assert bm.can_admit(hit, 48) and not bm.can_admit(hit, 49)
    # a hit on blocks already held by a live sequence costs nothing extra
    live = make_seq(toks(64))
    bm.admit(live, hit, 48)
    assert bm.num_free_blocks == 0
    assert bm.can_admit(bm.match_prefix(toks(40)), 32)
    assert not bm.can_admit(bm.match_prefix(toks(40)), 33)
    bm.check_invariants([other, live])


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = toks(50)
    a = admit_computed(bm, prompt)
    assert bm.match_prefix(prompt) == []
    assert bm.hash_to_block == {} and all(h == NO_HASH for h in bm.block_hash)
    bm.free(a)
    assert bm.match_prefix(prompt) == []
    bm.check_invariants([])


def test_hash_collision_is_caught_by_token_comparison(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda tokens, prev: 12345)
    bm = BlockManager(8, BS)
    admit_computed(bm, [1] * 20)
    assert len(bm.match_prefix([1] * 20)) == 1
    assert bm.match_prefix([2] * 20) == []  # same (forced) hash, different tokens: not a hit


def test_chain_hash_depends_on_tokens_and_prefix():
    a = chain_hash([1, 2, 3], NO_HASH)
    assert a == chain_hash([1, 2, 3], NO_HASH)
    assert a != chain_hash([1, 2, 4], NO_HASH)
    assert chain_hash([1, 2, 3], a) != a
    assert chain_hash([5], a) != chain_hash([5], chain_hash([1, 2, 4], NO_HASH))


def test_concurrent_identical_prefixes_keep_invariants():
    """Two sequences computing the same prefix at the same time each own a copy; both are hashed."""
    bm = BlockManager(8, BS)
    prompt = toks(40)
    a, b = make_seq(prompt), make_seq(prompt)
    bm.admit(a, [], 40)
    bm.admit(b, [], 40)  # admitted before a registered anything: no sharing
    assert not set(a.block_table) & set(b.block_table)
    for s in (a, b):
        s.num_computed_tokens = 40
        bm.register_computed_blocks(s)
    bm.check_invariants([a, b])
    assert bm.match_prefix(prompt + [0]) == a.block_table[:2]
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


# ---- check_invariants itself -----------------------------------------------------------------
def test_check_invariants_detects_corruption():
    bm = BlockManager(6, BS)
    a = admit_computed(bm, toks(40))
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_invariants([])  # a's blocks are referenced but no live sequence holds them
    bm.ref_count[a.block_table[0]] += 1
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_invariants([a])
    bm.ref_count[a.block_table[0]] -= 1
    stolen = next(iter(bm.free_blocks))
    del bm.free_blocks[stolen]
    with pytest.raises(AssertionError, match="free list"):
        bm.check_invariants([a])
    bm.free_blocks[stolen] = None
    bm.check_invariants([a])
    dup = make_seq(toks(3))
    dup.block_table = [stolen, stolen]
    with pytest.raises(AssertionError, match="repeats a block"):
        bm.check_invariants([a, dup])
    h = bm.block_hash[a.block_table[0]]
    bm.block_hash[a.block_table[0]] = NO_HASH
    with pytest.raises(AssertionError, match="hash map"):
        bm.check_invariants([a])
    bm.block_hash[a.block_table[0]] = h
    bm.check_invariants([a])
