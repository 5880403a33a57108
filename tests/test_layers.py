"""Small layers against their plain definitions."""
from __future__ import annotations

import torch

from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import rope_inverse_frequencies


def test_rmsnorm_matches_its_definition():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(8, 64)
    ref = norm(x)  # float32 path: x * rsqrt(mean(x^2) + eps) * weight
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(ref, expected)
    half = norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    torch.testing.assert_close(half.float(), ref, atol=3e-2, rtol=2e-2)


def test_llama3_rope_keeps_high_and_divides_low_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = rope_inverse_frequencies(128, 500000.0, None)
    scaled = rope_inverse_frequencies(128, 500000.0, scaling)
    wavelen = 2 * torch.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8)
    middle = ~high & ~low
    assert bool(((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all())


def test_rmsnorm_equals_hf_llama_rmsnorm_in_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(1)
    ours, hf = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        hf.weight.copy_(ours.weight)
    x = (torch.randn(16, 576) * 3).to(torch.bfloat16)
    assert torch.equal(ours.to(torch.bfloat16)(x), hf.to(torch.bfloat16)(x))
