"""Paged KV block allocator with reference counts, hash-chained prefix caching and a host pool.

A full block's hash covers its tokens and the hash of the block before it, so equal hashes mean
equal prefixes. Freed blocks keep their hash and stay findable until the allocator reuses them
(least recently freed first), which is what makes a later request with the same prefix a cache hit.

With CPU offload, a second pool of blocks lives in host memory. Block-table entries >= HOST_BASE name
host blocks (HOST_BASE + host id). New KV is always written to device blocks; when the device pool
runs short, full, already computed device blocks move to the host (`offload_blocks`): their device
ids are free at once, and the (device, host) pairs wait in `pending_offloads` for the model runner,
which copies them before anything is written into the reused device blocks. The prefix cache covers
device blocks only: a shared block never moves, and a block that moves leaves the cache.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence

NO_HASH = -1
HOST_BASE = 1 << 40


def is_host_block(block_id: int) -> bool:
    return block_id >= HOST_BASE


def chain_hash(token_ids: list[int], prev_hash: int) -> int:
    h = xxhash.xxh64()
    if prev_hash != NO_HASH:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash = [NO_HASH] * num_blocks
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.seq_block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its registered blocks
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks))  # a heap: lowest ids first, for long runs
        self.pending_offloads: dict[int, int] = {}  # host block -> device block to copy into it before the next step

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_used_host_blocks(self) -> int:
        return self.num_host_blocks - len(self.free_host_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup -------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks covering a prefix of token_ids. The last token is never covered, so at
        least one token is always computed (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        blocks, prev = [], NO_HASH
        for i in range((len(token_ids) - 1) // self.block_size):
            tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            prev = chain_hash(tokens, prev)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.block_token_ids[block_id] != tuple(tokens):
                break
            blocks.append(block_id)
        return blocks

    def fork_prefix(self, parent: Sequence, num_prompt_tokens: int) -> list[int]:
        """The parent's leading device blocks of computed prompt KV, for another sample of the same prompt
        to share (as match_prefix: never the block holding the last prompt token)."""
        limit = min((num_prompt_tokens - 1) // self.block_size, parent.num_computed_tokens // self.block_size)
        blocks = []
        for block_id in parent.block_table[:limit]:
            if is_host_block(block_id):
                break
            blocks.append(block_id)
        return blocks

    # ---- allocation ----------------------------------------------------------------------
    def can_admit(self, prefix_blocks: list[int], num_tokens: int) -> bool:
        """Whether a new sequence reusing prefix_blocks can hold num_tokens of KV."""
        reused_free = sum(1 for b in prefix_blocks if self.ref_count[b] == 0)
        new_blocks = self.blocks_for_tokens(num_tokens) - len(prefix_blocks)
        return new_blocks + reused_free <= self.num_free_blocks

    def admit(self, seq: Sequence, prefix_blocks: list[int], num_tokens: int) -> None:
        assert not seq.block_table, "sequence already holds blocks"
        for block_id in prefix_blocks:
            if self.ref_count[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_count[block_id] += 1
            seq.block_table.append(block_id)
        hashes = [self.block_hash[b] for b in prefix_blocks]  # a forked prefix may not be registered yet
        self.seq_block_hashes[seq.seq_id] = hashes[: hashes.index(NO_HASH)] if NO_HASH in hashes else hashes
        seq.num_computed_tokens = seq.num_cached_tokens = len(prefix_blocks) * self.block_size
        self.grow(seq, num_tokens)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for_tokens(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks until seq can hold num_tokens of KV (call can_grow first)."""
        needed = self.blocks_for_tokens(num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {needed} blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        self._forget_hash(block_id)
        self.ref_count[block_id] = 1
        return block_id

    def _forget_hash(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h != NO_HASH and self.hash_to_block.get(h) == block_id:
            del self.hash_to_block[h]
        self.block_hash[block_id] = NO_HASH
        self.block_token_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; tail blocks are freed first so shared prefixes live longest."""
        for block_id in reversed(seq.block_table):
            if is_host_block(block_id):
                host_block = block_id - HOST_BASE
                self.pending_offloads.pop(host_block, None)  # its copy is moot, and the id may be reused at once
                heapq.heappush(self.free_host_blocks, host_block)
                continue
            self.ref_count[block_id] -= 1
            assert self.ref_count[block_id] >= 0, f"double free of block {block_id}"
            if self.ref_count[block_id] == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        self.seq_block_hashes.pop(seq.seq_id, None)

    # ---- offload to the host pool ---------------------------------------------------------
    def offload_blocks(self, num_blocks: int, seqs: list[Sequence]) -> int:
        """Move up to num_blocks full, computed device blocks of seqs (in that order of preference,
        the latest blocks of each first) to the host pool, as far as it has room. Returns how many moved."""
        num_blocks = min(num_blocks, len(self.free_host_blocks))
        victims: list[tuple[Sequence, int]] = []
        for seq in seqs:
            full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
            for i in range(full - 1, -1, -1):
                if len(victims) == num_blocks:
                    break
                block = seq.block_table[i]
                if not is_host_block(block) and self.ref_count[block] == 1:  # shared prefix blocks stay
                    victims.append((seq, i))
        victims.sort(key=lambda v: (v[0].seq_id, v[1]))  # ascending host ids along each sequence: long copy runs
        for seq, i in victims:
            device_block = seq.block_table[i]
            host_block = heapq.heappop(self.free_host_blocks)
            self.pending_offloads[host_block] = device_block
            seq.block_table[i] = HOST_BASE + host_block
            self.ref_count[device_block] = 0
            self._forget_hash(device_block)  # its KV is no longer on the device to be shared
            self.free_blocks[device_block] = None
        return len(victims)

    def take_pending_offloads(self) -> list[tuple[int, int]]:
        """(device block, host block) pairs to copy before this step's first KV write."""
        pending, self.pending_offloads = self.pending_offloads, {}
        return [(device, host) for host, device in pending.items()]

    # ---- prefix cache registration -------------------------------------------------------
    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash every full block whose KV is now computed, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        hashes = self.seq_block_hashes.get(seq.seq_id)
        if hashes is None:
            hashes = self.seq_block_hashes[seq.seq_id] = []
        elif len(hashes) >= num_full:  # called per token with async scheduling: most calls find nothing new
            return
        for i in range(len(hashes), num_full):
            tokens = seq.block_tokens(i)
            h = chain_hash(tokens, hashes[-1] if hashes else NO_HASH)
            hashes.append(h)
            block_id = seq.block_table[i]
            if not is_host_block(block_id) and self.block_hash[block_id] == NO_HASH:
                self.block_hash[block_id] = h
                self.block_token_ids[block_id] = tuple(tokens)
                self.hash_to_block.setdefault(h, block_id)

    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Reference counts equal the block-table references; free list equals unreferenced blocks."""
        counts = [0] * self.num_blocks
        host_used: set[int] = set()
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id} repeats a block"
            for b in seq.block_table:
                if is_host_block(b):
                    assert b - HOST_BASE not in host_used, f"host block {b - HOST_BASE} is shared"
                    host_used.add(b - HOST_BASE)
                else:
                    counts[b] += 1
        assert host_used.isdisjoint(self.free_host_blocks), "a host block in use is also free"
        assert len(host_used) + len(self.free_host_blocks) == self.num_host_blocks, "host blocks leaked"
        assert counts == self.ref_count, "reference counts differ from block tables"
        free = {b for b in range(self.num_blocks) if counts[b] == 0}
        assert free == set(self.free_blocks), "free list differs from unreferenced blocks"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} holding another hash"
