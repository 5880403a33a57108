"""Fused Triton layer ops against the PyTorch reference (LayerOps), every output element.

Without CUDA the kernels run in Triton's CPU interpreter at small sizes; on CUDA also in bf16/fp16 at
the model shapes of the benchmarks. Inputs are fresh random tensors with a spread of magnitudes.
"""
from __future__ import annotations

import pytest
import torch

from nanovllm.layers.fused_ops import LayerOps, get_layer_ops
from nanovllm.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if CUDA else [torch.float32]
# Differences come from reduction order and exp/rsqrt approximations, then at most one rounding step.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope="module")
def triton_ops():
    pytest.importorskip("triton")
    return get_layer_ops("triton")


def rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 96), (3, 1024)])
def test_rms_norm_and_residual_add(triton_ops, dtype, rows, cols):
    ref = LayerOps()
    x = rand(rows, cols, dtype=dtype, seed=1, scale=3.0)
    residual = rand(rows, cols, dtype=dtype, seed=2)
    weight = (rand(cols, dtype=torch.float32, seed=3) * 0.5 + 1.0).to(dtype)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), **TOL[dtype])
    got_norm, got_sum = triton_ops.add_rms_norm(x, residual, weight, 1e-6)
    want_norm, want_sum = ref.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got_sum, want_sum)  # one rounded add: exact
    torch.testing.assert_close(got_norm, want_norm, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (4, 2 * 1500)])
def test_silu_and_mul(triton_ops, dtype, rows, cols):
    gate_up = rand(rows, cols, dtype=dtype, seed=4, scale=4.0)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), LayerOps().silu_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 64)])
def test_qk_norm_rope_from_packed_qkv(triton_ops, dtype, qk_norm, heads, kv_heads, head_dim):
    """q and k are strided views into one qkv projection output, as in the model."""
    tokens = 7
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5, scale=2.0)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.unflatten(-1, (heads, head_dim)), k.unflatten(-1, (kv_heads, head_dim))
    positions = torch.tensor([0, 1, 5, 17, 100, 1000, 4095], device=DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None).cos_sin(positions, dtype)
    weights = [(rand(head_dim, dtype=torch.float32, seed=s) * 0.3 + 1.0).to(dtype) for s in (6, 7)] if qk_norm \
        else [None, None]
    got = triton_ops.qk_norm_rope(q, k, cos, sin, *weights, 1e-6)
    want = LayerOps().qk_norm_rope(q, k, cos, sin, *weights, 1e-6)
    for g, w in zip(got, want):
        assert g.is_contiguous()
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("hidden,inter,heads,kv_heads", [(1024, 3072, 16, 8), (4096, 14336, 32, 8)])
def test_fused_ops_at_model_sizes_cuda(triton_ops, hidden, inter, heads, kv_heads):
    dtype, tokens, head_dim = torch.bfloat16, 300, 128
    ref = LayerOps()
    x, residual = rand(tokens, hidden, dtype=dtype, seed=8), rand(tokens, hidden, dtype=dtype, seed=9)
    weight = (rand(hidden, dtype=torch.float32, seed=10) * 0.2 + 1).to(dtype)
    for g, w in zip(triton_ops.add_rms_norm(x, residual, weight, 1e-6), ref.add_rms_norm(x, residual, weight, 1e-6)):
        torch.testing.assert_close(g, w, **TOL[dtype])
    gate_up = rand(tokens, 2 * inter, dtype=dtype, seed=11, scale=3)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **TOL[dtype])
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=12)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.unflatten(-1, (heads, head_dim)), k.unflatten(-1, (kv_heads, head_dim))
    cos, sin = RotaryEmbedding(head_dim, 1e6, None).cos_sin(torch.arange(tokens, device=DEVICE) * 97, dtype)
    weights = (rand(head_dim, dtype=dtype, seed=13), rand(head_dim, dtype=dtype, seed=14))
    for g, w in zip(triton_ops.qk_norm_rope(q, k, cos, sin, *weights, 1e-6),
                    ref.qk_norm_rope(q, k, cos, sin, *weights, 1e-6)):
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.cuda
def test_fused_ops_round_like_pytorch_in_bf16_cuda(triton_ops):
    """Rounding of every intermediate as PyTorch does (nearest-even at the same points): apart from
    float32 reduction-order effects, the results are bitwise those of the reference."""
    dtype, ref = torch.bfloat16, LayerOps()
    x, residual = rand(256, 576, dtype=dtype, seed=15, scale=4), rand(256, 576, dtype=dtype, seed=16, scale=4)
    weight = (rand(576, dtype=torch.float32, seed=17) * 0.3 + 1).to(dtype)
    gate_up = rand(256, 2 * 1536, dtype=dtype, seed=18, scale=4)
    qkv = rand(256, 15 * 64, dtype=dtype, seed=19, scale=2)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.unflatten(-1, (9, 64)), k.unflatten(-1, (3, 64))
    cos, sin = RotaryEmbedding(64, 1e4, None).cos_sin(torch.arange(256, device=DEVICE) * 31, dtype)
    pairs = [(triton_ops.add_rms_norm(x, residual, weight, 1e-5)[0], ref.add_rms_norm(x, residual, weight, 1e-5)[0]),
             (triton_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)),
             (triton_ops.qk_norm_rope(q, k, cos, sin, None, None, 1e-5)[0],
              ref.qk_norm_rope(q, k, cos, sin, None, None, 1e-5)[0])]
    for got, want in pairs:
        assert (got == want).float().mean().item() > 0.99


def test_unknown_layer_ops_name_is_refused():
    with pytest.raises(ValueError, match="available"):
        get_layer_ops("cuda-magic")


def test_rms_norm_over_the_last_dim_of_any_shape(triton_ops):
    x = rand(3, 4, 64, dtype=torch.float32, seed=20)
    weight = rand(64, dtype=torch.float32, seed=21)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), LayerOps().rms_norm(x, weight, 1e-6),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [(2, 16), (3, 80), (8, 128)])
def test_store_kv_equals_index_copy(triton_ops, dtype, heads, head_dim):
    """The one-launch KV write against the caches' two index_copy_ (engine/kv_cache.py's reference): k and
    v as views of one projection (row strides past their width), slots in any order across blocks and
    strided (a decode graph's slots are a column of its input rows)."""
    from nanovllm.kernels.triton_fused import store_kv

    blocks, block_size, tokens = 6, 16, 11
    qkv = rand(tokens, 3 * heads * head_dim, dtype=dtype, seed=heads)
    k = qkv[:, heads * head_dim: 2 * heads * head_dim].view(tokens, heads, head_dim)
    v = qkv[:, 2 * heads * head_dim:].view(tokens, heads, head_dim)
    cache = rand(2, blocks, block_size, heads, head_dim, dtype=dtype, seed=1)
    rows = torch.zeros(tokens, 5, dtype=torch.int64, device=DEVICE)
    rows[:, 2] = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(heads))[:tokens]
    slots = rows[:, 2]
    want = cache.clone()
    want[0].view(-1, heads, head_dim).index_copy_(0, slots, k)
    want[1].view(-1, heads, head_dim).index_copy_(0, slots, v)
    store_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("ops_name", ["torch", "triton"])
def test_qk_norm_rope_stores_k_and_v_as_store_kv_would(triton_ops, dtype, qk_norm, ops_name):
    """With store, the op also writes its rotated k and the given v at the slots (strided: a column of a decode
    graph's input rows; any order across blocks): the caches equal those store_kv makes of the returned k,
    every other slot untouched, and q, k equal the op without store."""
    from nanovllm.engine.kv_cache import store_kv

    ops = get_layer_ops(ops_name)
    heads, kv_heads, head_dim, tokens, blocks, block_size = 6, 2, 32, 9, 5, 16
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=11, scale=2.0)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
    positions = torch.arange(tokens, device=DEVICE) * 37
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None).cos_sin(positions, dtype)
    weights = [(rand(head_dim, dtype=torch.float32, seed=s) * 0.3 + 1.0).to(dtype) for s in (12, 13)] if qk_norm \
        else [None, None]
    rows = torch.zeros(tokens, 4, dtype=torch.int64, device=DEVICE)
    rows[:, 2] = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(3))[:tokens].to(DEVICE)
    cache = rand(2, blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=14)
    want_cache = cache.clone()
    got_q, got_k = ops.qk_norm_rope(q, k, cos, sin, *weights, 1e-6, store=(v, cache[0], cache[1], rows[:, 2]))
    want_q, want_k = ops.qk_norm_rope(q, k, cos, sin, *weights, 1e-6)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    store_kv(want_k, v, want_cache[0], want_cache[1], rows[:, 2])
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("store", [False, True])
def test_qkv_rope_through_the_gemv_equals_projection_then_rope(triton_ops, dtype, rows, bias, store):
    """`TritonLayerOps.qkv_rope` at 1-3 rows (the GEMV with RoPE and the store in its epilogue, kernels/triton_gemv.
    gemv_rope) gives the q, k, v and caches that the projection followed by the RoPE kernel gives, bit for bit, and
    the PyTorch reference's within tolerance; with a q/k norm (Qwen3) or more rows than gemv_rows it is that path."""
    from nanovllm.layers.fused_ops import TritonLayerOps

    heads, kv_heads, head_dim, hidden, blocks, block_size = 6, 2, 32, 80, 4, 16
    linear = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias).to(DEVICE, dtype)
    x = rand(rows, hidden, dtype=dtype, seed=21)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None).cos_sin(torch.arange(rows, device=DEVICE) * 53 + 7, dtype)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(5))[:rows].to(DEVICE)
    caches = [rand(2, blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=22) for _ in range(3)]
    fused, unfused = TritonLayerOps(gemv_rows=4), TritonLayerOps(gemv_rows=4)
    unfused.gemv_rope = None  # must not be called: the fallback path below
    results = []
    for ops, cache in zip((fused, LayerOps(), None), caches):
        target = (cache[0], cache[1], slots) if store else None
        if ops is None:  # the unfused Triton path: GEMV, then the RoPE kernel storing k and v
            results.append(LayerOps.qkv_rope(fused, x, linear, (heads, kv_heads, head_dim), cos, sin, None, None, 1e-6,
                                             target))
        else:
            results.append(ops.qkv_rope(x, linear, (heads, kv_heads, head_dim), cos, sin, None, None, 1e-6, target))
    (got, ref, want), (got_cache, ref_cache, want_cache) = results, caches
    for g, r, w in zip(got, ref, want):
        assert torch.equal(g, w)
        torch.testing.assert_close(g, r, **TOL[dtype])
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got_cache, ref_cache, **TOL[dtype])
    norm = (torch.ones(head_dim, dtype=dtype, device=DEVICE),) * 2
    assert unfused.qkv_rope(x, linear, (heads, kv_heads, head_dim), cos, sin, *norm, 1e-6)[0].shape == (rows, heads,
                                                                                                        head_dim)
    unfused.gemv_rows = rows - 1
    unfused.qkv_rope(x, linear, (heads, kv_heads, head_dim), cos, sin, None, None, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_through_the_gemv_equals_projection_then_silu(dtype, rows, bias):
    """`TritonLayerOps.gate_up_silu` at 1-2 rows (SiLU * up in the GEMV's epilogue, kernels/triton_gemv.gemv_silu)
    equals the GEMV followed by the SiLU kernel bit for bit, and the PyTorch reference within tolerance; a projection
    wider than twice its input goes through it too (gate/up is), steps of more rows than gemv_rows do not."""
    from nanovllm.layers.fused_ops import TritonLayerOps

    hidden, inter = 48, 56  # 2 * inter > 2 * hidden
    linear = torch.nn.Linear(hidden, 2 * inter, bias=bias).to(DEVICE, dtype)
    x = rand(rows, hidden, dtype=dtype, seed=31)
    ops = TritonLayerOps(gemv_rows=2)
    got = ops.gate_up_silu(x, linear)
    want = ops.silu_and_mul(ops.gemv(x, linear.weight, linear.bias))
    assert got.shape == (rows, inter) and torch.equal(got, want)
    torch.testing.assert_close(got, LayerOps().gate_up_silu(x, linear), **TOL[dtype])
    ops.gemv_silu = None  # must not be called below
    assert ops.gate_up_silu(rand(3, hidden, dtype=dtype, seed=32), linear).shape == (3, inter)


def test_qk_norm_rope_store_errors_name_the_mismatch(triton_ops):
    q, k, v = rand(2, 4, 16, dtype=torch.float32, seed=1), rand(2, 2, 16, dtype=torch.float32, seed=2), \
        rand(2, 2, 16, dtype=torch.float32, seed=3)
    cos, sin = RotaryEmbedding(16, 10000.0, None).cos_sin(torch.arange(2, device=DEVICE), torch.float32)
    cache = rand(2, 3, 16, 2, 16, dtype=torch.float32, seed=4)
    slots = torch.tensor([0, 5], device=DEVICE)
    with pytest.raises(ValueError, match="v shaped as k"):
        triton_ops.qk_norm_rope(q, k, cos, sin, None, None, 1e-6, store=(v[:, :1], cache[0], cache[1], slots))
    with pytest.raises(ValueError, match="differ"):
        triton_ops.qk_norm_rope(q, k, cos, sin, None, None, 1e-6, store=(v, cache[0].double(), cache[1].double(),
                                                                          slots))


def test_qk_norm_rope_kernel_compiles_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects: the RoPE kernel with and without the KV store, bf16,
    Llama's heads, through Triton's own ptxas."""
    pytest.importorskip("triton")
    from compiled_helpers import assert_runs_compiled

    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_fused import _qk_norm_rope_kernel as kernel
names = kernel.arg_names
first_constexpr = names.index("NUM_Q_HEADS")
sig = {name: "i32" for name in names[:first_constexpr]}
sig.update({name: "*bf16" for name in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cos_ptr", "sin_ptr", "qw_ptr",
                                       "kw_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}, slots_ptr="*i64", eps="fp32")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
for store in (False, True):
    for heads, kv_heads, norm in ((32, 8, False), (14, 2, True)):  # Llama-3.1-8B; Qwen2.5-0.5B's pads, a norm
        consts = dict(NUM_Q_HEADS=heads, NUM_K_HEADS=kv_heads, HEAD_DIM=128, HAS_NORM=norm, STORE=store,
                      Q_HEADS_PAD=triton.next_power_of_2(heads), K_HEADS_PAD=triton.next_power_of_2(kv_heads))
        compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "enable_fp_fusion": False})
        assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)
