"""Long prefill chunks through cuDNN (kernels/cudnn_prefill.py) against the float32 reference. On the CPU
the gathering, the pieces and their log-sum-exp merges run with a PyTorch stand-in for cuDNN; on CUDA
with cuDNN itself, in bf16, and through the triton backend's dispatch."""
from __future__ import annotations

import pytest
import torch

from nanovllm.kernels import cudnn_prefill
from nanovllm.kernels.reference import paged_attention_reference
from nanovllm.layers.attention import AttentionMetadata
from test_kernels import CUDA, DEVICE, assert_matches, make_batch

# whole prompts, chunks over a prefix of several pieces, partial first and last blocks
QUERY_LENS, SEQ_LENS = [40, 24, 33], [40, 101, 33 + 70]


@pytest.mark.parametrize("piece", [16, 32, 4096])
def test_pieces_and_merges_equal_the_reference(monkeypatch, piece):
    monkeypatch.setattr(cudnn_prefill, "PIECE", piece)
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=3, head_dim=16, block_size=16, dtype=torch.float32)
    want = paged_attention_reference(*batch.args(0.3))
    got = cudnn_prefill.gathered_prefill_attention(batch.q, batch.k_cache, batch.v_cache, QUERY_LENS, SEQ_LENS,
                                                   batch.block_tables, 0.3, attend=cudnn_prefill.attend_reference)
    assert_matches(got, want, torch.float32)


def test_writes_into_given_outputs():
    batch = make_batch([20], [50], num_kv_heads=1, group=2, head_dim=16, block_size=16, dtype=torch.float32)
    out = (torch.zeros_like(batch.q), torch.zeros(batch.q.shape[:2]))
    got = cudnn_prefill.gathered_prefill_attention(batch.q, batch.k_cache, batch.v_cache, [20], [50],
                                                   batch.block_tables, 0.5, attend=cudnn_prefill.attend_reference,
                                                   out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert_matches(out, paged_attention_reference(*batch.args(0.5)), torch.float32)


def test_only_long_half_precision_chunks_on_cuda_use_it():
    q = torch.zeros(2048, 4, 64, dtype=torch.bfloat16)
    tables = torch.zeros(2, 8, dtype=torch.int64)
    assert not cudnn_prefill.usable(q, [1024, 1024], tables)  # on the CPU
    if CUDA:
        assert cudnn_prefill.usable(q.cuda(), [1024, 1024], tables)
        assert not cudnn_prefill.usable(q.cuda(), [2047, 1], tables)  # a decode row: mixed batch
        assert not cudnn_prefill.usable(q.cuda().float(), [1024, 1024], tables)
        assert not cudnn_prefill.usable(q.cuda(), [1024, 1024], tables[:, None])  # per-head tables


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_equals_the_reference(monkeypatch, dtype):
    monkeypatch.setattr(cudnn_prefill, "PIECE", 1024)
    query_lens, seq_lens = [1024, 1500], [1024, 1500 + 2600]
    batch = make_batch(query_lens, seq_lens, num_kv_heads=2, group=4, head_dim=128, block_size=256, dtype=dtype)
    want = paged_attention_reference(*batch.args(128 ** -0.5))
    got = cudnn_prefill.gathered_prefill_attention(batch.q, batch.k_cache, batch.v_cache, query_lens, seq_lens,
                                                   batch.block_tables, 128 ** -0.5)
    assert_matches(got, want, dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_triton_backend_sends_long_chunks_to_cudnn(monkeypatch):
    from nanovllm.layers.triton_attention import TritonPagedAttention

    query_lens, seq_lens = [1100, 1030], [1100, 3000]
    batch = make_batch(query_lens, seq_lens, num_kv_heads=2, group=4, head_dim=128, block_size=256,
                       dtype=torch.bfloat16)
    meta = AttentionMetadata(query_lens, seq_lens, [], torch.empty(0), batch.cu_query_lens, batch.seq_lens,
                             batch.block_tables, 256)
    backend = TritonPagedAttention()
    assert backend.cudnn_prefill
    calls, cudnn = [], cudnn_prefill.attend_cudnn
    monkeypatch.setattr(cudnn_prefill, "attend_cudnn", lambda *a: calls.append(a[4]) or cudnn(*a))
    got = backend.forward_with_lse(batch.q, batch.k_cache, batch.v_cache, meta, 0.1)
    assert calls == [True, False, True]  # the first sequence: its own keys; the second: a prefix piece, its own
    backend.cudnn_prefill = False
    triton = backend.forward_with_lse(batch.q, batch.k_cache, batch.v_cache, meta, 0.1)
    assert_matches(got, paged_attention_reference(*batch.args(0.1)), torch.bfloat16)
    assert_matches(triton, paged_attention_reference(*batch.args(0.1)), torch.bfloat16)
    assert len(calls) == 3 and DEVICE.type == "cuda"
