"""Paged-attention kernels against the float32 reference, on every output element (out and lse).

Without CUDA the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py
before Triton is imported) at small sizes in float32 (and a little float16). On CUDA the same tests run in
bfloat16/float16/float32 with block size 256 too, plus tests at real sizes (marked cuda).
Unused cache slots are filled with NaN, so any read past a sequence's end or through a padded
block-table entry shows up in the comparison.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from compiled_helpers import assert_runs_compiled
from nanovllm.kernels.reference import HostKV, KeyCodes, merge_attention_states, paged_attention_reference
from nanovllm.engine.kv_cache import store_kv
from nanovllm.layers.attention import get_attention_backend

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32]
BLOCK_SIZES = [16, 64, 256] if CUDA else [16, 64]
# (out atol, out rtol, lse atol): the reference reads the same rounded inputs, computes in float32.
TOLERANCES = {torch.float32: (2e-5, 2e-5, 2e-5), torch.float16: (2e-3, 1e-2, 1e-3),
              torch.bfloat16: (1e-2, 2e-2, 1e-3)}


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("triton")
    from nanovllm.kernels import triton_paged_attention

    return triton_paged_attention


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor
    cu_query_lens: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int64 [B, max_blocks], -1 padded
    query_lens_list: list[int]
    seq_lens_list: list[int]

    def args(self, scale: float) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.cu_query_lens, self.seq_lens, self.block_tables, scale)


def make_batch(query_lens: list[int], seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0, q_scale: float = 1.0) -> Batch:
    """Random caches with shuffled block ids; slots past each sequence's end and spare blocks hold NaN."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    counts = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(counts) + 3
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [ids[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(shape, generator=g, device=DEVICE, dtype=dtype)
    _poison_unused(k_cache, v_cache, tables, seq_lens, ids[sum(counts):])
    width = max(counts)
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int64, device=DEVICE)
    cu = torch.tensor([0] + [sum(query_lens[: i + 1]) for i in range(len(query_lens))], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g, device=DEVICE, dtype=dtype)
    return Batch(q * q_scale, k_cache, v_cache, cu.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                 padded, list(query_lens), list(seq_lens))


def _poison_unused(k_cache, v_cache, tables, seq_lens, spare_blocks) -> None:
    block_size = k_cache.shape[1]
    for table, seq_len in zip(tables, seq_lens):
        if not table:
            continue
        tail = seq_len - (len(table) - 1) * block_size
        for cache in (k_cache, v_cache):
            cache[table[-1], tail:] = float("nan")
    for cache in (k_cache, v_cache):
        cache[spare_blocks] = float("nan")


def assert_matches(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], dtype) -> None:
    out_atol, out_rtol, lse_atol = TOLERANCES[dtype]
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=out_atol, rtol=out_rtol)
    torch.testing.assert_close(got[1], want[1], atol=lse_atol, rtol=1e-5)


def random_mixed_lens(rng: random.Random, num_seqs: int, max_query: int, max_seq: int) -> tuple[list[int], list[int]]:
    """Decode rows, whole prefills (no cached prefix) and chunks over a cached prefix, shuffled."""
    query_lens, seq_lens = [1, 1], [max_seq, rng.randint(1, max_seq)]  # one decode row at the longest length
    q = rng.randint(1, max_query)
    query_lens.append(q), seq_lens.append(q)  # whole prefill
    q = rng.randint(1, max_query)
    query_lens.append(q), seq_lens.append(rng.randint(q + 1, max_seq))  # chunk over a cached prefix
    while len(query_lens) < num_seqs:
        q = rng.randint(1, max_query)
        query_lens.append(q), seq_lens.append(rng.randint(q, max_seq))
    order = list(range(len(query_lens)))
    rng.shuffle(order)
    return [query_lens[i] for i in order], [seq_lens[i] for i in order]


# ---------------------------------------------------------------------------------------------
# Reference and merge (no Triton needed)


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """q [n, H, D] over all of keys/values [S, H, D] (no mask); returns (out [n, H, D], lse [n, H])."""
    scores = torch.einsum("qhd,khd->qhk", q, keys) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("qhk,khd->qhd", torch.exp(scores - lse[..., None]), values), lse


def test_merge_of_two_key_parts_equals_attention_over_all_keys():
    g = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(n, 4, 32, generator=g, dtype=torch.float64) for n in (5, 40, 40))
    full = dense_attention(q, keys, values, 0.2)
    for cut in (1, 17, 39):
        a = dense_attention(q, keys[:cut], values[:cut], 0.2)
        b = dense_attention(q, keys[cut:], values[cut:], 0.2)
        torch.testing.assert_close(merge_attention_states(*a, *b), (full[0], full[1].float()))
        torch.testing.assert_close(merge_attention_states(*b, *a), (full[0], full[1].float()))


def test_merge_with_an_empty_part():
    g = torch.Generator().manual_seed(1)
    out, lse = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, generator=g)
    empty_out, empty_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("-inf"))
    torch.testing.assert_close(merge_attention_states(out, lse, empty_out, empty_lse), (out, lse))
    torch.testing.assert_close(merge_attention_states(empty_out, empty_lse, out, lse), (out, lse))
    merged_out, merged_lse = merge_attention_states(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(merged_out, torch.zeros_like(out)) and torch.isneginf(merged_lse).all()


def test_reference_matches_torch_backend():
    rng = random.Random(0)
    query_lens, seq_lens = random_mixed_lens(rng, 6, 40, 120)
    b = make_batch(query_lens, seq_lens, num_kv_heads=2, group=3, head_dim=32, block_size=16, dtype=torch.float32)
    out, lse = paged_attention_reference(*b.args(0.17))
    backend = get_attention_backend("torch")
    meta = backend.build_metadata(query_lens, seq_lens, [[int(x) for x in t if x >= 0] for t in b.block_tables],
                                  _new_token_slots(b), b.k_cache.shape[1], DEVICE)
    want = backend.forward(b.q, b.k_cache, b.v_cache, meta, 0.17)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert lse.shape == out.shape[:2] and torch.isfinite(lse).all()


@pytest.mark.parametrize("max_group_tokens", [1 << 12, 200])
def test_torch_backend_decode_rows_in_groups_match_the_reference(monkeypatch, max_group_tokens):
    """Decode rows of very different KV lengths beside prefill rows (slots past each end hold NaN): gathered in
    groups padded to their longest (one group per row at the smallest bound), they equal the reference."""
    from nanovllm.layers import attention

    monkeypatch.setattr(attention, "MAX_GROUP_TOKENS", max_group_tokens)
    query_lens, seq_lens = [1, 1, 7, 1, 1, 1, 30, 1], [3, 150, 40, 17, 149, 64, 30, 1]
    b = make_batch(query_lens, seq_lens, num_kv_heads=2, group=3, head_dim=32, block_size=16, dtype=torch.float32)
    out, _ = paged_attention_reference(*b.args(0.17))
    backend = get_attention_backend("torch")
    meta = backend.build_metadata(query_lens, seq_lens, [[int(x) for x in t if x >= 0] for t in b.block_tables],
                                  _new_token_slots(b), b.k_cache.shape[1], DEVICE)
    torch.testing.assert_close(backend.forward(b.q, b.k_cache, b.v_cache, meta, 0.17), out, atol=1e-5, rtol=1e-5)


def test_decode_groups_hold_every_row_once_within_their_bounds():
    from nanovllm.layers.attention import MAX_GROUP_TOKENS, PAD_SLACK, _decode_groups

    rng = random.Random(3)
    seq_lens = [rng.choice([rng.randint(1, 64), rng.randint(1, 40_000)]) for _ in range(300)]
    rows = [i for i in range(300) if i % 7]
    groups = _decode_groups(rows, seq_lens)
    assert sorted(i for g in groups for i in g) == rows
    for g in groups:
        longest = max(seq_lens[i] for i in g)
        assert len(g) == 1 or len(g) * longest <= min(MAX_GROUP_TOKENS,
                                                      PAD_SLACK * sum(seq_lens[i] for i in g) + 16 * len(g))
    short = [i for i in rows if seq_lens[i] <= 64]
    assert len(_decode_groups(short, seq_lens)) <= len(short) / 8  # short rows of similar lengths share a group


def _new_token_slots(b: Batch) -> list[int]:
    """Cache slots of each sequence's new (last query_len) tokens."""
    bs = b.k_cache.shape[1]
    slots = []
    for i, (n, s) in enumerate(zip(b.query_lens_list, b.seq_lens_list)):
        table = b.block_tables[i].tolist()
        slots += [table[p // bs] * bs + p % bs for p in range(s - n, s)]
    return slots


def _new_kv(b: Batch, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V already in the cache at the new tokens' slots (writing them back changes nothing)."""
    heads, dim = b.k_cache.shape[2:]
    return b.k_cache.view(-1, heads, dim)[slots].clone(), b.v_cache.view(-1, heads, dim)[slots].clone()


# ---------------------------------------------------------------------------------------------
# Kernels at small sizes (CPU interpreter or CUDA)

HEADS = [(2, 1), (1, 4), (1, 8)]  # (num_kv_heads, group = Hq / Hk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,group", HEADS)
def test_prefill_kernel_mixed_batch(ops, kv_heads, group, head_dim, block_size, dtype):
    rng = random.Random(hash((kv_heads, group, head_dim, block_size)) % 1000)
    query_lens, seq_lens = random_mixed_lens(rng, 5, 70, 300)
    b = make_batch(query_lens, seq_lens, kv_heads, group, head_dim, block_size, dtype, seed=rng.randint(0, 99))
    scale = head_dim**-0.5
    assert_matches(ops.paged_prefill_attention(*b.args(scale)), paged_attention_reference(*b.args(scale)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,group", HEADS)
def test_decode_kernel(ops, kv_heads, group, head_dim, block_size, dtype):
    rng = random.Random(hash((kv_heads, group, head_dim, block_size, 1)) % 1000)
    seq_lens = [1, 300, rng.randint(2, 300), 2 * block_size]  # one key, long, random, exactly full blocks
    b = make_batch([1] * 4, seq_lens, kv_heads, group, head_dim, block_size, dtype, seed=rng.randint(0, 99))
    scale = head_dim**-0.5
    want = paged_attention_reference(*b.args(scale))
    assert_matches(ops.paged_decode_attention(*b.args(scale)), want, dtype)
    assert_matches(ops.paged_decode_attention(*b.args(scale), num_splits=1), want, dtype)


def move_blocks_to_host(b: Batch, every: int, base: int = 1 << 40) -> tuple[torch.Tensor, HostKV]:
    """Every `every`-th block of each table moved into a host pool (pinned on CUDA): returns the tables
    naming them base + host id, and the pool. The device copies become NaN, so reading them shows."""
    tables = b.block_tables.clone()
    moved = [(i, j) for i in range(tables.shape[0]) for j in range(tables.shape[1])
             if tables[i, j] >= 0 and j % every == 0]
    pin = DEVICE.type == "cuda"
    shape = (len(moved) + 2, *b.k_cache.shape[1:])
    host = HostKV(torch.full(shape, float("nan"), dtype=b.k_cache.dtype, pin_memory=pin),
                  torch.full(shape, float("nan"), dtype=b.k_cache.dtype, pin_memory=pin), base)
    for h, (i, j) in enumerate(reversed(moved)):  # host ids in another order than the device ids
        block = int(tables[i, j])
        host.k[h].copy_(b.k_cache[block]), host.v[h].copy_(b.v_cache[block])
        b.k_cache[block], b.v_cache[block] = float("nan"), float("nan")
        tables[i, j] = base + h
    return tables, host


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_reads_host_blocks_in_place(ops, num_splits):
    """Blocks in a (pinned) host pool, named by table entries >= base, read by the decode kernel where
    they lie: the same result as with every block on the device, and the reference agrees (None: the
    host-read split rule, here HOST_READ_SPLITS splits of 19 tiles)."""
    dtype = DTYPES[0]
    b = make_batch([1] * 4, [1, 70, 33, 300], 2, 4, 64, 16, dtype, seed=num_splits or 7)
    want = paged_attention_reference(*b.args(0.125))
    tables, host = move_blocks_to_host(b, every=2)
    args = (b.q, b.k_cache, b.v_cache, b.cu_query_lens, b.seq_lens, tables, 0.125)
    assert_matches(paged_attention_reference(*args, host_kv=host), want, dtype)
    assert_matches(ops.paged_decode_attention(*args, num_splits=num_splits, block_n=16, host_kv=host), want, dtype)


def host_key_codes(host: HostKV) -> HostKV:
    """The pool with its keys as int8 codes on the device (Quest's key copy) and its own keys NaN: the kernel
    must read host keys from the codes only."""
    from nanovllm.layers.block_metadata import quantize_keys

    codes, scales = quantize_keys(host.k.to(DEVICE).float().nan_to_num(0.0), 8)
    host.k.fill_(float("nan"))
    return host._replace(key_codes=KeyCodes(codes, scales))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_host_keys_from_their_codes(ops, num_splits):
    """Host blocks' keys from int8 codes on the device and their values from the host: the reference over the
    dequantized keys agrees, per-head tables too, and the result stays within the codes' rounding of the
    bf16-exact answer (device blocks still read their own keys)."""
    dtype = DTYPES[0]
    b = make_batch([1] * 4, [1, 70, 33, 300], 2, 4, 64, 16, dtype, seed=11 + num_splits)
    exact = paged_attention_reference(*b.args(0.125))
    tables, host = move_blocks_to_host(b, every=2)
    host = host_key_codes(host)
    args = (b.q, b.k_cache, b.v_cache, b.cu_query_lens, b.seq_lens, tables, 0.125)
    want = paged_attention_reference(*args, host_kv=host)
    assert not want[0].isnan().any()
    assert_matches(ops.paged_decode_attention(*args, num_splits=num_splits, block_n=16, host_kv=host), want, dtype)
    torch.testing.assert_close(want[0].float(), exact[0].float(), atol=3e-2, rtol=0)  # int8 keys: close, not equal
    assert (want[0].float() - exact[0].float()).abs().max() > 0  # the codes were used
    per_head = tables[:, None].expand(-1, 2, -1).contiguous()  # every KV head over the same blocks
    lens = b.seq_lens[:, None].expand(-1, 2).contiguous()
    args = (b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens, per_head, 0.125)
    assert_matches(ops.paged_decode_attention(*args, num_splits=num_splits, block_n=16, host_kv=host), want, dtype)
    assert_matches(paged_attention_reference(*args, host_kv=host), want, dtype)


def test_key_codes_must_match_the_cache_layout(ops):
    b = make_batch([1], [20], 1, 2, 64, 16, torch.float32)
    host = HostKV(b.k_cache.clone(), b.v_cache.clone(), 100,
                  KeyCodes(torch.zeros(2, 16, 1, 32, dtype=torch.int8), torch.zeros(2, 16, 1)))
    with pytest.raises(ValueError, match="key codes"):
        ops.paged_decode_attention(*b.args(0.1), host_kv=host)


def test_host_caches_must_match_the_device_layout(ops):
    b = make_batch([1], [20], 1, 2, 64, 16, torch.float32)
    bad = HostKV(torch.zeros(2, 16, 1, 32), torch.zeros(2, 16, 1, 32), 100)
    with pytest.raises(ValueError, match="block shape"):
        ops.paged_decode_attention(*b.args(0.1), host_kv=bad)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_decode_splits_including_empty_ones(ops, num_splits):
    """16 splits over sequences of 1..4 tiles leave most splits without keys."""
    b = make_batch([1] * 5, [1, 15, 16, 17, 64], 1, 4, 64, 16, torch.float32, seed=num_splits)
    want = paged_attention_reference(*b.args(0.125))
    assert_matches(ops.paged_decode_attention(*b.args(0.125), num_splits=num_splits, block_n=16), want, torch.float32)


def test_one_split_decode_takes_128_key_tiles(ops, monkeypatch):
    """A launch of one split reads 128-key tiles where K rows are at most 256 bytes and the block holds them;
    sequences ending inside, at and past a tile's end, with the default split rule and one split forced."""
    assert ops.one_split_tile_size(torch.bfloat16, 128, 256) == 128
    assert ops.one_split_tile_size(torch.float32, 64, 256) == 128
    assert ops.one_split_tile_size(torch.float32, 128, 256) == 64  # 512-byte rows keep the usual tile
    assert ops.one_split_tile_size(torch.bfloat16, 128, 64) == 64  # a tile stays inside a block
    seen = []
    kernel = ops._decode_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["BLOCK_N"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(ops, "_decode_kernel", Recording())
    b = make_batch([1] * 5, [1, 127, 128, 129, 300], 1, 2, 64, 128, torch.float32, seed=3)
    want = paged_attention_reference(*b.args(0.125))
    assert_matches(ops.paged_decode_attention(*b.args(0.125), num_splits=1), want, torch.float32)
    assert_matches(ops.paged_decode_attention(*b.args(0.125)), want, torch.float32)  # 3 tiles of 128 keys: one split
    assert_matches(ops.paged_decode_attention(*b.args(0.125), num_splits=2), want, torch.float32)
    assert seen == [128, 128, 64]


@pytest.mark.parametrize("num_splits", [17, 40, 64])
def test_decode_merge_of_more_than_16_splits(ops, num_splits):
    """Rows of 1, 300 and 1,000 keys in 16-key tiles over 17 to 64 splits: the merge takes the long row's 17 to 63
    splits with keys, the 1-key row's one."""
    b = make_batch([1] * 3, [1, 300, 1000], 2, 4, 64, 16, torch.float32, seed=num_splits)
    want = paged_attention_reference(*b.args(0.125))
    assert_matches(ops.paged_decode_attention(*b.args(0.125), num_splits=num_splits, block_n=16), want, torch.float32)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("block_m,block_n,block_size", [(16, 16, 16), (32, 16, 64), (128, 64, 64), (64, 32, 32),
                                                         (256, 64, 64)])  # 256 rows: tune_prefill's --block-m 256
def test_prefill_tile_shapes(ops, block_m, block_n, block_size, tma):
    rng = random.Random(block_m + block_n)
    query_lens, seq_lens = random_mixed_lens(rng, 4, 70, 200)
    b = make_batch(query_lens, seq_lens, 2, 4, 64, block_size, torch.float32, seed=3)
    schedule = ops.build_prefill_schedule(query_lens, block_m, DEVICE, seq_lens)
    config = ops.PrefillConfig(block_m, block_n, num_warps=4, num_stages=2, tma=tma)
    got = ops.paged_prefill_attention(*b.args(0.125), schedule=schedule, config=config)
    assert_matches(got, paged_attention_reference(*b.args(0.125)), torch.float32)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "history"])
def test_prefill_descriptors_with_per_head_tables_and_accumulation(ops, causal):
    """Tensor-descriptor K/V loads over per-KV-head tables, merged into a partial result; a cache the
    descriptor cannot cover (a strided view) falls back to pointer loads with the same result."""
    rng = random.Random(11)
    query_lens, seq_lens = random_mixed_lens(rng, 5, 40, 150)
    b = make_batch(query_lens, seq_lens, 2, 3, 32, 16, torch.float32, seed=6)
    tables, lens = _per_head_selection(b, 2, seed=2)
    config = ops.PrefillConfig(32, 16, num_warps=4, num_stages=2, tma=True)
    args = (b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens, tables, 0.2)
    want = paged_attention_reference(*args, causal=causal)
    assert_matches(ops.paged_prefill_attention(*args, causal=causal, config=config), want, torch.float32)
    held = paged_attention_reference(*b.args(0.2), causal=causal)
    merged = merge_attention_states(held[0], held[1], want[0], want[1])
    out = (held[0].clone(), held[1].clone())
    ops.paged_prefill_attention(*args, causal=causal, config=config, out=out, accumulate=True)
    assert_matches(out, merged, torch.float32)
    strided_k = torch.cat([b.k_cache, b.k_cache], dim=-1)[..., :32]
    assert not strided_k.is_contiguous()
    got = ops.paged_prefill_attention(b.q, strided_k, b.v_cache, *args[3:], causal=causal, config=config)
    assert_matches(got, want, torch.float32)


def test_kernels_in_float16(ops):
    query_lens, seq_lens = [1, 33, 5], [90, 33, 70]
    b = make_batch(query_lens, seq_lens, 2, 2, 64, 16, torch.float16, seed=5)
    want = paged_attention_reference(*b.args(0.125))
    assert_matches(ops.paged_prefill_attention(*b.args(0.125)), want, torch.float16)
    d = make_batch([1, 1], [90, 7], 2, 2, 64, 16, torch.float16, seed=6)
    assert_matches(ops.paged_decode_attention(*d.args(0.125), num_splits=2), paged_attention_reference(*d.args(0.125)),
                   torch.float16)


@pytest.mark.parametrize("head_dim", [32, 256])
def test_other_head_dims(ops, head_dim):
    dtype = DTYPES[0]
    b = make_batch([1, 40], [70, 90], 1, 2, head_dim, 16, dtype, seed=8)
    want = paged_attention_reference(*b.args(0.1))
    assert_matches(ops.paged_prefill_attention(*b.args(0.1)), want, dtype)
    d = make_batch([1, 1], [70, 90], 1, 2, head_dim, 16, dtype, seed=9)
    assert_matches(ops.paged_decode_attention(*d.args(0.1)), paged_attention_reference(*d.args(0.1)), dtype)


def test_head_dim_not_a_power_of_two_is_refused(ops):
    b = make_batch([1], [5], 1, 1, 96, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        ops.paged_decode_attention(*b.args(0.1))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_split_between_kernels(ops, num_splits):
    """One-token rows through the decode kernel (seq_ids), the others through the prefill kernel."""
    query_lens, seq_lens = [1, 30, 1, 1, 7], [200, 30, 1, 64, 90]
    b = make_batch(query_lens, seq_lens, 1, 4, 64, 16, torch.float32, seed=13)
    schedule = ops.build_prefill_schedule(query_lens, 64, DEVICE, seq_lens, skip_single_token=True)
    assert sorted(seq for seq, _ in schedule.tolist()) == [1, 4]
    out = ops.paged_prefill_attention(*b.args(0.125), schedule=schedule)
    seq_ids = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    got = ops.paged_decode_attention(*b.args(0.125), seq_ids=seq_ids, num_splits=num_splits, out=out)
    assert got[0] is out[0]
    assert_matches(got, paged_attention_reference(*b.args(0.125)), torch.float32)


def test_decode_launches_read_host_inputs_early_only_under_dependent_launch(ops, monkeypatch):
    """Where dependent launches apply, the decode and merge kernels read the host's lengths and tables before waiting
    (EARLY), except over per-KV-head tables (a selection kernel's output) or host KV; a split batch-1 step over
    device KV runs one pipeline stage, every other launch two. The launches are recorded, not run (the interpreter
    has no PDL)."""
    from nanovllm.kernels import dependent_launch

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, kwargs))

    monkeypatch.setattr(ops, "_decode_kernel", Recorder("decode"))
    monkeypatch.setattr(ops, "_merge_splits_kernel", Recorder("merge"))
    b = make_batch([1, 1], [40, 50], 2, 2, 32, 16, torch.float32, seed=3)
    tables, lens = _per_head_selection(b, 2, seed=4)
    host = HostKV(b.k_cache.clone(), b.v_cache.clone(), b.k_cache.shape[0])
    one = make_batch([1], [70], 2, 2, 32, 16, torch.float32, seed=5)
    host_one = HostKV(one.k_cache.clone(), one.v_cache.clone(), one.k_cache.shape[0])
    cases = [  # (supported, call, EARLY, stages)
        (True, lambda: ops.paged_decode_attention(*b.args(0.1), num_splits=2, pdl=True), True, 2),
        (True, lambda: ops.paged_decode_attention(*one.args(0.1), num_splits=4, pdl=True), True, 1),
        (True, lambda: ops.paged_decode_attention(*one.args(0.1), num_splits=4, pdl=True,
                                                  seq_ids=torch.tensor([0], device=DEVICE)), True, 2),
        (True, lambda: ops.paged_decode_attention(*one.args(0.1), num_splits=1, pdl=True), True, 2),
        (True, lambda: ops.paged_decode_attention(*one.args(0.1), num_splits=4, pdl=False), False, 1),
        (False, lambda: ops.paged_decode_attention(*one.args(0.1), num_splits=4, pdl=True), False, 1),
        (True, lambda: ops.paged_decode_attention(b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens, tables, 0.1,
                                                  num_splits=2, pdl=True), False, 2),
        (True, lambda: ops.paged_decode_attention(*b.args(0.1), num_splits=2, pdl=True, host_kv=host), False, 2),
        (True, lambda: ops.paged_decode_attention(*one.args(0.1), num_splits=4, pdl=True, host_kv=host_one), False, 2),
    ]
    for supported, call, early, stages in cases:
        monkeypatch.setattr(dependent_launch, "supported", lambda device, on=supported: on)
        launches.clear()
        call()
        decode = launches[0][1]
        assert launches[0][0] == "decode" and decode["EARLY"] is early and decode["num_stages"] == stages
        assert all(kwargs["EARLY"] is early for _, kwargs in launches[1:])
    assert ops.decode_num_stages(1, 64, False, False) == 1 and ops.decode_num_stages(1, 1, False, False) == 2
    assert ops.decode_num_stages(2, 64, False, False) == 2 and ops.decode_num_stages(1, 64, True, False) == 2
    assert ops.decode_num_stages(1, 64, False, True) == 2


def test_int32_block_tables(ops):
    b = make_batch([1, 20], [40, 50], 1, 2, 64, 16, torch.float32, seed=7)
    want = paged_attention_reference(*b.args(0.125))
    b.block_tables = b.block_tables.to(torch.int32)
    assert_matches(ops.paged_prefill_attention(*b.args(0.125)), want, torch.float32)


def test_num_splits_depend_on_shapes_only(ops):
    assert ops.decode_num_splits(64, 8, 32768, 64, 132) == 1  # 512 programs: no split, no merge
    assert ops.decode_num_splits(30, 8, 32768, 64, 132) == 1  # 240 programs: 1.8 waves
    assert ops.decode_num_splits(29, 8, 32768, 64, 132) == 3  # 232 programs: 4 waves want 3 splits
    assert ops.decode_num_splits(16, 8, 32768, 64, 132) == 5
    assert ops.decode_num_splits(1, 8, 32768, 64, 132) == 64  # capped by MAX_SPLITS
    assert ops.decode_num_splits(1, 8, 256, 64, 132) == 1  # 4 tiles: no split
    assert ops.decode_num_splits(4, 2, 1024, 64, 132) == 4  # 16 tiles, >= 4 tiles per split
    assert ops.kv_tile_size(256, 64) == 64 and ops.kv_tile_size(48, 64) == 16 and ops.kv_tile_size(32, 64) == 32
    assert ops.decode_tile_size(torch.bfloat16, 128, 256) == 64 and ops.decode_tile_size(torch.float32, 256, 256) == 32


def test_prefill_schedule_costliest_first(ops):
    schedule = ops.build_prefill_schedule([3, 130, 1], 64, torch.device("cpu"), [3, 1000, 2000])
    assert schedule.dtype == torch.int32
    assert schedule.tolist() == [[2, 0], [1, 2], [1, 1], [1, 0], [0, 0]]


# ---------------------------------------------------------------------------------------------
# The backend: KV writes plus attention, against the torch backend


def _run_backend(name: str, b: Batch, meta_args: tuple, new_k, new_v, scale: float):
    backend = get_attention_backend(name)
    meta = backend.build_metadata(*meta_args)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    store_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)  # what KVAccess does before attending
    out = backend.forward(b.q, k_cache, v_cache, meta, scale)
    return backend, meta, out, k_cache, v_cache


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
def test_backend_matches_torch_backend(ops, decode):
    rng = random.Random(int(decode))
    if decode:
        query_lens, seq_lens = [1] * 4, [rng.randint(1, 150) for _ in range(4)]
    else:
        query_lens, seq_lens = random_mixed_lens(rng, 5, 40, 150)
    dtype = DTYPES[0]
    b = make_batch(query_lens, seq_lens, 2, 4, 64, 16, dtype, seed=11)
    tables = [[int(x) for x in t if x >= 0] for t in b.block_tables]
    slots = _new_token_slots(b)
    g = torch.Generator(DEVICE).manual_seed(12)
    new_k, new_v = (torch.randn(len(slots), 2, 64, generator=g, device=DEVICE, dtype=dtype) for _ in range(2))
    meta_args = (query_lens, seq_lens, tables, slots, 16, DEVICE)
    _, _, want, want_k, want_v = _run_backend("torch", b, meta_args, new_k, new_v, 0.125)
    backend, meta, got, got_k, got_v = _run_backend("triton", b, meta_args, new_k, new_v, 0.125)
    assert torch.equal(got_k.nan_to_num(), want_k.nan_to_num()) and torch.equal(got_v.nan_to_num(), want_v.nan_to_num())
    out_atol, out_rtol, _ = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=out_atol, rtol=out_rtol)
    out, lse = backend.forward_with_lse(b.q, got_k, got_v, meta, 0.125)
    ref = paged_attention_reference(b.q, got_k, got_v, meta.cu_query_lens, meta.seq_lens_tensor,
                                    meta.block_tables_tensor, 0.125)
    assert_matches((out, lse), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_kernel_non_causal(ops, dtype):
    """History attention (CPU offload): every query row sees all of its sequence's keys."""
    query_lens, seq_lens = [5, 40, 2, 17], [32, 16, 48, 64]  # more queries than keys is allowed too
    b = make_batch(query_lens, seq_lens, 2, 4, 64, 16, dtype, seed=5)
    got = ops.paged_prefill_attention(*b.args(0.1), causal=False)
    want = paged_attention_reference(*b.args(0.1), causal=False)
    assert_matches(got, want, dtype)
    causal = paged_attention_reference(*b.args(0.1))
    assert not torch.allclose(causal[1], want[1])  # the two modes really differ on these shapes


def test_history_attention_matches_torch_backend(ops):
    """Both backends merge history attention into a partial result by LSE: decode and prefill rows;
    rows of sequences without keys keep what they held; rows that held nothing (lse -inf) take the part."""
    dtype = DTYPES[0]
    query_lens, seq_lens = [3, 1, 20, 1, 4], [32, 0, 48, 16, 0]
    b = make_batch(query_lens, seq_lens, 2, 2, 64, 16, dtype, seed=6)
    tables = [[int(x) for x in t if x >= 0] for t in b.block_tables]
    g = torch.Generator(DEVICE).manual_seed(7)
    held_out = torch.randn(b.q.shape, generator=g, device=DEVICE)
    held_lse = torch.randn(b.q.shape[:2], generator=g, device=DEVICE) * 3
    held_lse[[0, 3, 5, 24]] = float("-inf")  # nothing held yet: a prefill row, a decode row, empty-sequence rows
    results = []
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)
        meta = backend.build_metadata(query_lens, seq_lens, tables, [], 16, DEVICE)
        out = (held_out.clone(), held_lse.clone())
        backend.history_attention(b.q, b.k_cache, b.v_cache, meta, 0.2, out)
        results.append(out)
    part = paged_attention_reference(*b.args(0.2), causal=False)
    want = merge_attention_states(held_out, held_lse, part[0].float(), part[1])
    empty_rows = [3, 25, 26, 27, 28]  # rows of the two sequences without keys
    want[0][empty_rows], want[1][empty_rows] = held_out[empty_rows], held_lse[empty_rows]
    for out, lse in results:
        torch.testing.assert_close(out, want[0], atol=TOLERANCES[dtype][0], rtol=TOLERANCES[dtype][1])
        torch.testing.assert_close(lse, want[1], atol=TOLERANCES[dtype][2], rtol=1e-5)
        assert torch.equal(out[empty_rows], held_out[empty_rows])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_and_prefill_kernels_accumulate_into_a_partial_result(ops, num_splits):
    """accumulate=True equals attention over both key sets: split the keys of each sequence in two caches."""
    dtype = DTYPES[0]
    query_lens, seq_lens = [1, 6, 1], [40, 24, 33]
    first = make_batch(query_lens, seq_lens, 2, 2, 64, 16, dtype, seed=8)
    second = make_batch(query_lens, [16, 8, 17], 2, 2, 64, 16, dtype, seed=9)
    second.q = first.q
    out = [t.clone() for t in paged_attention_reference(*first.args(0.15), causal=False)]
    out[0] = out[0].float()
    ops.paged_decode_attention(*second.args(0.15), seq_ids=torch.tensor([0, 2], device=DEVICE), num_splits=num_splits,
                               out=out, accumulate=True)
    schedule = ops.build_prefill_schedule(query_lens, ops.prefill_config(dtype, 64, 16).block_m, DEVICE,
                                          skip_single_token=True)
    ops.paged_prefill_attention(*second.args(0.15), schedule=schedule, out=out, causal=False, accumulate=True)
    want = merge_attention_states(*paged_attention_reference(*first.args(0.15), causal=False),
                                  *paged_attention_reference(*second.args(0.15), causal=False))
    torch.testing.assert_close(out[0], want[0].float(), atol=TOLERANCES[dtype][0], rtol=TOLERANCES[dtype][1])
    torch.testing.assert_close(out[1], want[1], atol=TOLERANCES[dtype][2], rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_model_greedy_tokens_match_torch_backend(tiny_llama, device):
    """End to end through the engine: chunked prefill, a shared prefix hit, batched decode."""
    pytest.importorskip("triton")
    if device == "cpu" and CUDA:
        pytest.skip("Triton runs on the CPU only through the interpreter")
    from nanovllm import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 21)]
    prompts.append(torch.randint(0, 256, (9,), generator=g).tolist())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=48,
                  device=device, dtype="float32", attention_backend=backend)
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]


# ---------------------------------------------------------------------------------------------
# Real sizes (CUDA only)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_long_contexts_cuda(ops, dtype):
    rng = random.Random(0)
    seq_lens = [32768, 1, 256, 257] + [rng.randint(1, 32768) for _ in range(60)]
    b = make_batch([1] * 64, seq_lens, 8, 4, 128, 256, dtype, seed=1, q_scale=2.0)
    scale = 128**-0.5
    want = paged_attention_reference(*b.args(scale))
    assert_matches(ops.paged_decode_attention(*b.args(scale)), want, dtype)
    assert_matches(ops.paged_decode_attention(*b.args(scale), num_splits=16), want, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_prefill_chunk_over_long_cached_prefix_cuda(ops, dtype):
    """A 4K-token chunk over an 8K cached prefix, batched with a decode row and a short prefill."""
    query_lens, seq_lens = [4096, 1, 300], [4096 + 8192, 5000, 300]
    b = make_batch(query_lens, seq_lens, 8, 4, 128, 256, dtype, seed=2, q_scale=2.0)
    scale = 128**-0.5
    assert_matches(ops.paged_prefill_attention(*b.args(scale)), paged_attention_reference(*b.args(scale)), dtype)


@pytest.mark.cuda
def test_decode_without_host_sync_and_in_cuda_graph(ops):
    """The backend's decode path runs under sync-debug 'error' and replays in a CUDA graph on new data."""
    dtype, block_size, width = torch.bfloat16, 256, 32  # table width 32: a bound of 8192 tokens
    b = make_batch([1] * 8, [4096] * 8, 8, 4, 128, block_size, dtype, seed=3)
    backend = get_attention_backend("triton")
    tables = [[int(x) for x in t] for t in b.block_tables]
    meta = backend.build_metadata([1] * 8, [4096] * 8, tables, _new_token_slots(b), block_size, DEVICE)
    meta.block_tables_tensor = torch.nn.functional.pad(meta.block_tables_tensor, (0, width - 16), value=-1)
    new_k, new_v = _new_kv(b, meta.slot_mapping)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        store_kv(new_k, new_v, b.k_cache, b.v_cache, meta.slot_mapping)
        return backend.forward_with_lse(b.q, b.k_cache, b.v_cache, meta, 0.1)

    run()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    new_lens = torch.tensor([1, 17, 256, 257, 1000, 2048, 3000, 4096], dtype=torch.int32, device=DEVICE)
    meta.seq_lens_tensor.copy_(new_lens)
    b.q.copy_(torch.randn_like(b.q))
    last = [n - 1 for n in new_lens.tolist()]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in enumerate(last)]
    meta.slot_mapping.copy_(torch.tensor(slots, device=DEVICE))
    new_k.copy_(_new_kv(b, meta.slot_mapping)[0]), new_v.copy_(_new_kv(b, meta.slot_mapping)[1])
    graph.replay()
    want = paged_attention_reference(b.q, b.k_cache, b.v_cache, meta.cu_query_lens, meta.seq_lens_tensor,
                                      meta.block_tables_tensor, 0.1)
    assert_matches((out, lse), want, dtype)


def _per_head_selection(b: Batch, num_kv_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and KV head a random subset of the blocks that precede its first query (the blocks
    holding queries kept): tables [B, Hk, max_blocks] (-1 padded) and compacted lengths [B, Hk]."""
    g = torch.Generator().manual_seed(seed)
    bs = b.k_cache.shape[1]
    tables, lens = [], []
    for i, (n, s) in enumerate(zip(b.query_lens_list, b.seq_lens_list)):
        blocks = b.block_tables[i, : -(-s // bs)].tolist()
        first = (s - n) // bs
        head_tables, head_lens = [], []
        for _ in range(num_kv_heads):
            keep = (torch.rand(len(blocks), generator=g) < 0.5).tolist()
            kept = [x for c, x in enumerate(blocks) if keep[c] or c >= first]
            head_tables.append(kept)
            head_lens.append(s - (len(blocks) - len(kept)) * bs)
        tables.append(head_tables)
        lens.append(head_lens)
    width = max(len(t) for ts in tables for t in ts)
    padded = [[t + [-1] * (width - len(t)) for t in ts] for ts in tables]
    return (torch.tensor(padded, dtype=torch.int64, device=DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "history"])
def test_prefill_kernel_with_per_head_tables(ops, causal):
    """Block-sparse prefill: every KV head over its own compacted table (mixed chunks and whole prefills)."""
    rng = random.Random(7)
    query_lens, seq_lens = random_mixed_lens(rng, 5, 40, 150)
    b = make_batch(query_lens, seq_lens, 2, 3, 32, 16, torch.float32, seed=5)
    tables, lens = _per_head_selection(b, 2, seed=1)
    args = (b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens, tables, 0.2)
    want = paged_attention_reference(*args, causal=causal)
    assert_matches(ops.paged_prefill_attention(*args, causal=causal), want, torch.float32)
    assert not torch.equal(want[0], paged_attention_reference(*b.args(0.2), causal=causal)[0])  # it is sparse


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("kv_heads,group,block_m", [(2, 4, 32), (1, 8, 64), (2, 2, 16), (2, 3, 32), (2, 4, 256)],
                         ids=["group4", "group8", "group2", "group3-unpacked", "group4-256rows"])
def test_prefill_kernel_with_packed_heads(ops, kv_heads, group, block_m, tma):
    """A program over a KV head's query heads (block_m // group queries of each): dense and per-KV-head tables,
    causal and history, merged into a partial result, equal to the reference; a group that does not divide the
    tile into a power of two runs a head per program."""
    rng = random.Random(group + block_m)
    query_lens, seq_lens = random_mixed_lens(rng, 5, 70, 200)
    b = make_batch(query_lens, seq_lens, kv_heads, group, 32, 16, torch.float32, seed=group)
    config = ops.PrefillConfig(block_m, 16, num_warps=4, num_stages=2, tma=tma, pack_heads=True)
    assert config.tile_queries(group) == (block_m if group == 3 else block_m // group)
    tables, lens = _per_head_selection(b, kv_heads, seed=group)
    for args in (b.args(0.2), (b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens, tables, 0.2)):
        for causal in (True, False):
            want = paged_attention_reference(*args, causal=causal)
            assert_matches(ops.paged_prefill_attention(*args, config=config, causal=causal), want, torch.float32)
            partial = (torch.zeros(b.q.shape, device=DEVICE), torch.full(b.q.shape[:2], float("-inf"), device=DEVICE))
            got = ops.paged_prefill_attention(*args, config=config, causal=causal, out=partial, accumulate=True)
            assert_matches(got, want, torch.float32)


def test_packed_prefill_kernel_compiles_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects: the packed prefill kernel (Llama's shape, bf16, per-KV-head
    tables, K/V through tensor descriptors and through pointers; 256-row tiles on 8 warps as tune_prefill may try)
    compiled for sm_90 through Triton's ptxas, within a Hopper block's shared memory."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_paged_attention import _prefill_kernel as kernel
first_constexpr = kernel.arg_names.index("GROUP")
for tma, block_m, warps in ((True, 128, 4), (False, 128, 4), (True, 256, 8)):  # 256 rows: tune_prefill's widest
    cache = "tensordesc<bf16[64,128]>" if tma else "*bf16"
    sig = {name: "i32" for name in kernel.arg_names[:first_constexpr]}
    sig.update(q_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, out_ptr="*bf16", lse_ptr="*fp32", cu_ptr="*i32",
               seq_lens_ptr="*i32", tables_ptr="*i64", schedule_ptr="*i32", qk_scale="fp32")
    sig.update({name: "constexpr" for name in kernel.arg_names[first_constexpr:]})
    consts = dict(GROUP=4, BLOCK_SIZE=256, HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=64, PRECISION="tf32", CAUSAL=True,
                  ACCUMULATE=True, PER_HEAD=True, TMA=tma, PACK=True, TILE=block_m // 4)
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 3})
    assert compiled.metadata.shared <= 232448  # an H100/H200 block's shared memory
    assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=600)


def test_decode_kernel_with_per_head_tables(ops):
    query_lens, seq_lens = [1] * 5, [150, 40, 97, 16, 129]
    b = make_batch(query_lens, seq_lens, 2, 4, 32, 16, torch.float32, seed=6)
    tables, lens = _per_head_selection(b, 2, seed=2)
    args = (b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens, tables, 0.3)
    want = paged_attention_reference(*args)
    for splits in (1, 3):
        assert_matches(ops.paged_decode_attention(*args, num_splits=splits, block_n=16), want, torch.float32)
    with pytest.raises(ValueError, match="per-head block tables need"):
        ops.paged_decode_attention(b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens[:, :1], tables, 0.3)


@pytest.mark.parametrize("accumulate", [False, True])
def test_decode_merge_reads_only_the_splits_with_tiles(ops, monkeypatch, accumulate):
    """Empty splits return at once and write nothing (a decode graph's split count follows max_model_len, not the
    step's lengths): whatever the partial buffers hold (NaN here), the merge reads only the splits with tiles, per
    KV head with its own length too."""
    b = make_batch([1] * 4, [3, 40, 97, 150], 2, 4, 32, 16, torch.float32, seed=12)
    tables, lens = _per_head_selection(b, 2, seed=5)
    args = (b.q, b.k_cache, b.v_cache, b.cu_query_lens, lens, tables, 0.3)
    want = paged_attention_reference(*args)
    empty = torch.empty

    def poisoned(*shape, **kwargs):
        t = empty(*shape, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    out = (torch.zeros_like(b.q), torch.full(b.q.shape[:2], float("-inf"), device=DEVICE)) if accumulate else None
    monkeypatch.setattr(torch, "empty", poisoned)
    for splits in (7, 64):
        got = ops.paged_decode_attention(*args, num_splits=splits, block_n=16,
                                         out=None if out is None else tuple(t.clone() for t in out),
                                         accumulate=accumulate)
        assert_matches(got, want, torch.float32)


def test_triton_backend_with_per_head_metadata(ops):
    """A block-sparse selection's metadata (build_head_metadata) through the triton backend equals the torch
    backend: a mixed batch (decode rows to the decode kernel, chunks to the prefill kernel) and history; also with
    the prefill kernel's programs over a KV head's query heads (pack_heads: the plans' query tiles follow)."""
    rng = random.Random(9)
    query_lens, seq_lens = random_mixed_lens(rng, 5, 30, 120)
    b = make_batch(query_lens, seq_lens, 2, 2, 32, 16, torch.float32, seed=8)
    tables, lens = _per_head_selection(b, 2, seed=3)
    results = []
    for name, pack in (("torch", False), ("triton", False), ("triton", True)):
        backend = get_attention_backend(name)
        backend.pack_heads = pack
        meta = backend.build_head_metadata(query_lens, lens.cpu(), tables.cpu(), 16, DEVICE)
        out = backend.forward(b.q, b.k_cache, b.v_cache, meta, 0.25)
        partial = (torch.zeros(b.q.shape, device=DEVICE), torch.full(b.q.shape[:2], float("-inf"), device=DEVICE))
        backend.history_attention(b.q, b.k_cache, b.v_cache, meta, 0.25, partial)
        results.append((out, partial))
        if pack:
            tiles = {plan.config.tile_queries(2) for plan in meta.plans.values()}
            assert tiles == {plan.config.block_m // 2 for plan in meta.plans.values()}
    (want, want_history), *triton_results = results
    for got, got_history in triton_results:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got_history[0], want_history[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got_history[1], want_history[1], atol=2e-5, rtol=2e-5)


def test_decode_kernel_with_key_codes_compiles_for_sm90_without_a_gpu():
    """The interpreter runs fp32 only: the decode kernel reading host keys from int8 codes, compiled for sm_90
    through Triton's own ptxas with bf16 queries on tensor cores (Llama-3.1-8B's shape: 4 query heads per KV head,
    16-token pages; SmolLM2's: 3 per KV head, head_dim 64), split (empty splits returning at once) and direct; and
    the merge of the splits with tiles."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_paged_attention import _decode_kernel as kernel
names = kernel.arg_names
first_constexpr = names.index("GROUP")
sig = {name: "i32" for name in names[:first_constexpr]}
sig.update(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*fp32", lse_ptr="*fp32", cu_ptr="*i32",
           seq_lens_ptr="*i32", tables_ptr="*i64", seq_ids_ptr="*i32", qk_scale="fp32", host_k_delta="i64",
           host_v_delta="i64", host_base="i64", codes_ptr="*i8", scales_ptr="*fp32")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
for group, dim, direct in [(4, 128, False), (4, 128, True), (3, 64, False)]:
    consts = dict(GROUP=group, GROUP_PAD=16, BLOCK_SIZE=16, HEAD_DIM=dim, BLOCK_N=16, INDEXED=False, DIRECT=direct,
                  PRECISION="tf32", ACCUMULATE=False, HOST_KV=True, PER_HEAD=True, KEY_CODES=True, PDL=False,
                  EARLY=False)
    out = "*bf16" if direct else "*fp32"
    compiled = triton.compile(ASTSource(kernel, dict(sig, out_ptr=out), consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    assert compiled.asm["cubin"]
from nanovllm.kernels.triton_paged_attention import _merge_splits_kernel as merge
names = merge.arg_names
first_constexpr = names.index("HEAD_DIM")
sig = {name: "i32" for name in names[:first_constexpr]}
sig.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", cu_ptr="*i32",
           seq_ids_ptr="*i32", seq_lens_ptr="*i32")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
consts = dict(HEAD_DIM=128, INDEXED=False, ACCUMULATE=True, PDL=False, EARLY=False)
compiled = triton.compile(ASTSource(merge, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)


def test_host_launch_sizes_equal_tritons():
    """The wrappers' grid and padding sizes (kernels/sizes.py) equal Triton's constexpr helpers they replace."""
    triton = pytest.importorskip("triton")
    from nanovllm.kernels.sizes import cdiv, next_power_of_2

    for n in range(0, 2100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d)
