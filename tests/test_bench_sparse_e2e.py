"""bench/sparse.py's end-to-end prefill on random weights (the H200 runs it on the Llama-3.1-8B shape at 128K), on the
CPU at a toy size: both engines prefill the same prompt, XAttention at a density the threshold sets."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from sparse import e2e_prefill_random  # noqa: E402


def test_random_weights_prefill_density_follows_the_threshold(tiny_llama):
    """A higher threshold keeps more blocks; at a toy size the forced blocks (sink, diagonal, the prompt's last two
    query blocks) are a large share, so only the order and the bounds are checked."""
    options = dict(reps=1, device="cpu", dtype="float32", kvcache_block_size=16, xattn_block_size=16, xattn_stride=4,
                   max_num_batched_tokens=256)
    low, high = (e2e_prefill_random(str(tiny_llama), 480, threshold, **options) for threshold in (0.2, 0.8))
    assert low["context"] == 480 and low["cover"] == "group" and low["dense_s"] > 0 and low["xattention_s"] > 0
    assert low["speedup"] == low["dense_s"] / low["xattention_s"]
    assert 0 < low["density"] < high["density"] < 1


def test_a_context_at_the_models_limit_prefills_one_token_fewer(tiny_llama):
    """The H200 run asks for 131072 tokens of a model whose max_position_embeddings is 131072; the flip-and-copy
    peer times the same engine with the other tile layout, the packed-heads peer with the backend's pack_heads, the
    torch-estimate peer with the estimate's PyTorch path."""
    options = dict(reps=1, device="cpu", dtype="float32", kvcache_block_size=16, xattn_block_size=16, xattn_stride=4,
                   max_num_batched_tokens=256)
    result = e2e_prefill_random(str(tiny_llama), 512, 0.5, cover="head", flip_copy_peer=True, packed_heads_peer=True,
                                torch_estimate_peer=True, **options)  # the limit
    assert result["context"] == 511 and result["cover"] == "head" and 0 < result["density"] < 1
    for peer in ("flip_copy", "packed_heads", "torch_estimate"):
        assert result[f"xattention_{peer}_s"] > 0
        assert result[f"speedup_{peer}"] == result["dense_s"] / result[f"xattention_{peer}_s"]


def test_threshold_peers_switch_the_same_engine_to_their_density(tiny_llama):
    """A threshold peer times the XAttention engine at another threshold: its density is what an engine built at that
    threshold gets (the switch reaches the selector and is undone for the default's runs)."""
    options = dict(reps=1, device="cpu", dtype="float32", kvcache_block_size=16, xattn_block_size=16, xattn_stride=4,
                   max_num_batched_tokens=256)
    both = e2e_prefill_random(str(tiny_llama), 480, 0.2, peer_thresholds=(0.8,), **options)
    alone = e2e_prefill_random(str(tiny_llama), 480, 0.8, **options)
    assert both["density_threshold_0.8"] == alone["density"] > both["density"]
    assert both["speedup_threshold_0.8"] == both["dense_s"] / both["xattention_threshold_0.8_s"]
