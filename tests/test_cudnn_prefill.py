"""The triton backend's cuDNN prefill route (layers/cudnn_prefill.py): which steps take it, its log-sum-exp
merge kernel against the PyTorch reference (Triton's CPU interpreter without CUDA), and on a Hopper GPU
the route's output against the float32 reference on paged caches with NaN past each sequence's end."""
from __future__ import annotations

import pytest
import torch

from nanovllm.kernels.reference import merge_attention_states, paged_attention_reference
from nanovllm.layers import cudnn_prefill
from nanovllm.layers.attention import get_attention_backend
from tests.test_kernels import assert_matches, make_batch  # the Triton kernels' tolerances hold the route too

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
HOPPER = CUDA and cudnn_prefill.cudnn_attention_available(DEVICE)


def _metadata(query_lens: list[int], seq_lens: list[int], block_size: int, tables: list[list[int]] | None = None):
    tables = tables or [list(range(i * 100, i * 100 + -(-s // block_size))) for i, s in enumerate(seq_lens)]
    return get_attention_backend("torch").build_metadata(query_lens, seq_lens, tables, [], block_size, DEVICE)


@pytest.mark.parametrize("rows, heads, dim", [(5, 3, 16), (70, 2, 64)])
def test_merge_kernel_equals_the_reference(rows, heads, dim):
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_merge import merge_two_states

    g = torch.Generator(DEVICE).manual_seed(rows)
    # strided parts, as cuDNN's [1, H, T, D] results seen as [T, H, D] and its lse [1, H, T, 1] as [T, H]
    out_a, out_b = (torch.randn(heads, rows, dim, generator=g, device=DEVICE).transpose(0, 1) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(heads, rows, generator=g, device=DEVICE).t() for _ in range(2))
    lse_a[0, 0] = float("-inf")  # a part without keys: its out is ignored, even NaN
    out_a[0, 0] = float("nan")
    lse_a[1, 0] = lse_b[1, 0] = float("-inf")  # both empty: 0 and -inf
    got = merge_two_states(out_a, lse_a, out_b, lse_b)
    want = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert got[0].is_contiguous() and got[1].dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0][1, 0], torch.zeros(dim, device=DEVICE)) and torch.isneginf(got[1][1, 0])


def test_merge_kernel_refuses_mismatched_parts():
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_merge import merge_two_states

    a, lse = torch.zeros(4, 2, 16, device=DEVICE), torch.zeros(4, 2, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        merge_two_states(a, lse, a[:3], lse[:3])


@pytest.mark.parametrize("case, takes", [
    (dict(), True),
    (dict(query_lens=[1024, 1024], seq_lens=[1024, 2048]), False),  # a batch
    (dict(query_lens=[1023], seq_lens=[4000]), False),  # too few new tokens
    (dict(dtype=torch.float32), False),  # cuDNN's attention is 16-bit
    (dict(head_dim=256), False),
    (dict(seq_lens=[cudnn_prefill.MAX_GATHER_BYTES // (2 * 8 * 128 * 2) + 1]), False),  # the gathered copy
])
def test_which_steps_take_the_route(monkeypatch, case, takes):
    monkeypatch.setattr(cudnn_prefill, "cudnn_attention_available", lambda device: True)
    query_lens, seq_lens = case.get("query_lens", [2048]), case.get("seq_lens", [6000])
    dtype, dim = case.get("dtype", torch.bfloat16), case.get("head_dim", 128)
    q = torch.empty(sum(query_lens), 32, dim, dtype=dtype)
    k_cache = torch.empty(4, 16, 8, dim, dtype=dtype)
    assert cudnn_prefill.takes_cudnn_route(q, k_cache, _metadata(query_lens, seq_lens, 16)) is takes


def test_per_head_tables_stay_on_triton(monkeypatch):
    monkeypatch.setattr(cudnn_prefill, "cudnn_attention_available", lambda device: True)
    meta = _metadata([2048], [4096], 16)
    meta.block_tables_tensor = meta.block_tables_tensor[:, None].expand(-1, 8, -1)  # a sparse policy's tables
    q, k_cache = torch.empty(2048, 32, 128, dtype=torch.bfloat16), torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)
    assert not cudnn_prefill.takes_cudnn_route(q, k_cache, meta)


def test_not_taken_without_cuda():
    assert not cudnn_prefill.cudnn_attention_available(torch.device("cpu"))


@pytest.mark.skipif(not HOPPER, reason="needs torch's cuDNN attention on a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(8, 4, 128), (3, 3, 64), (2, 1, 128)])
@pytest.mark.parametrize("query_len, seq_len", [(1024, 1024), (1500, 1500), (1024, 3000), (2100, 2333)])
def test_route_equals_the_reference(dtype, block_size, kv_heads, group, head_dim, query_len, seq_len):
    b = make_batch([query_len], [seq_len], kv_heads, group, head_dim, block_size, dtype, seed=query_len + seq_len)
    backend = get_attention_backend("triton")
    meta = _metadata([query_len], [seq_len], block_size, [[int(x) for x in b.block_tables[0] if x >= 0]])
    got = backend.forward_with_lse(b.q, b.k_cache, b.v_cache, meta, head_dim ** -0.5)
    assert next(iter(meta.plans.values())).cudnn
    assert_matches((got[0], got[1].contiguous()), paged_attention_reference(*b.args(head_dim ** -0.5)), dtype)


def test_padded_rows_cover_the_chunk_with_at_most_an_eighth_more():
    padded = [cudnn_prefill.padded_rows(n) for n in range(cudnn_prefill.MIN_QUERY_TOKENS, 70000)]
    assert all(n <= p <= n + max(256, n / 8) for n, p in zip(range(cudnn_prefill.MIN_QUERY_TOKENS, 70000), padded))
    assert padded == sorted(padded) and len(set(padded)) < 60  # few shapes for cuDNN to plan


@pytest.mark.skipif(not HOPPER, reason="needs torch's cuDNN attention on a Hopper GPU")
def test_warm_up_plans_each_padded_size_once():
    count = cudnn_prefill.warm_up(6, 2, 64, torch.bfloat16, DEVICE, 3000)
    assert count == len({cudnn_prefill.padded_rows(n) for n in range(cudnn_prefill.MIN_QUERY_TOKENS, 3001)}) == 9
