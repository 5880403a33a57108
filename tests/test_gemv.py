"""The few-row linear kernel (kernels/triton_gemv.py) against F.linear, every output element.

Without CUDA it runs in Triton's CPU interpreter in float32 at small sizes (K not a multiple of the tile, N not
a multiple of the column block, with and without bias, strided rows); on CUDA also in bf16 at Llama-3.1-8B's
projection shapes. A compile test builds it for sm_90 through Triton's own ptxas on any machine.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_helpers import assert_runs_compiled

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def gemv():
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_gemv import gemv

    return gemv


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,block_n,block_k",
                         [(40, 96, 8, 32), (64, 300, 4, 128), (7, 16, 8, 64), (50, 70, None, None)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(gemv, rows, n, k, block_n, block_k, bias):
    x, w = rand(rows, k, seed=1), rand(n, k, seed=2) / k**0.5
    b = rand(n, seed=3) if bias else None
    got = gemv(x, w, b, block_n=block_n, block_k=block_k)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_gemv_reads_strided_rows_and_only_its_rows(gemv):
    """x a view of every other row of a larger buffer: the kernel must follow stride_xm and write M rows only."""
    buffer = rand(8, 32, seed=4)
    x, w = buffer[::2][:3], rand(24, 32, seed=5)
    torch.testing.assert_close(gemv(x, w, block_n=8, block_k=16), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_rope_and_silu_errors_name_the_limit(gemv):
    from nanovllm.kernels.triton_gemv import gemv_rope, gemv_silu

    cos = torch.ones(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="even number of outputs"):
        gemv_silu(rand(1, 32), rand(7, 32))
    with pytest.raises(ValueError, match="4 \\+ 2 x 2 heads of 16"):
        gemv_rope(rand(1, 32), rand(100, 32), None, 16, 4, 2, cos, cos)
    with pytest.raises(ValueError, match="cos and sin \\[1, 1, 16\\]"):
        gemv_rope(rand(1, 32), rand(128, 32), None, 16, 4, 2, cos[..., :8], cos)


def test_gemv_errors_name_the_limit(gemv):
    with pytest.raises(ValueError, match="1..4 rows"):
        gemv(rand(5, 32), rand(8, 32))
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        gemv(rand(2, 32), rand(8, 31))
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(rand(32, 2).t(), rand(8, 32))


def test_gemv_tiles_follow_the_tuned_shapes():
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_gemv import gemv_tiles

    assert gemv_tiles(6144, 4096) == (4, 1024)  # Llama-3.1-8B q/k/v
    assert gemv_tiles(4096, 4096) == (8, 1024)  # o
    assert gemv_tiles(4096, 14336) == (8, 1024)  # down
    assert gemv_tiles(960, 576) == (4, 1024)  # SmolLM2 q/k/v: K rounded up to a power of two
    assert gemv_tiles(64, 48) == (4, 64)


def test_layer_ops_route_only_narrow_one_rank_projections(gemv):
    """gemv_rows 1: a 1-row step's q/k/v-, o- and down-shaped nn.Linear go through the GEMV; gate/up (N > 2K), steps
    of more rows, a subclass of nn.Linear (a tensor-parallel shard) and gemv_rows 0 keep F.linear."""
    from nanovllm.layers.fused_ops import TritonLayerOps

    class Shard(torch.nn.Linear):
        pass

    ops, calls = TritonLayerOps(), []
    ops.gemv = lambda x, w, b, pdl: calls.append(tuple(w.shape)) or F.linear(x, w, b)
    narrow, wide = torch.nn.Linear(32, 48).to(DEVICE), torch.nn.Linear(32, 80).to(DEVICE)
    shard = Shard(32, 48).to(DEVICE)
    one, two = rand(1, 32), rand(2, 32)
    for x, linear in ((one, narrow), (one, wide), (two, narrow), (one, shard)):
        torch.testing.assert_close(ops.linear(x, linear), linear(x))
    assert calls == [(48, 32)]
    ops.gemv_rows = 0
    ops.linear(one, narrow)
    assert calls == [(48, 32)]
    with pytest.raises(ValueError, match="outside 0..4"):
        TritonLayerOps(gemv_rows=5)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_bf16_at_llama_shapes(gemv, rows, n, k):
    x, w = rand(rows, k, dtype=torch.bfloat16, seed=6), rand(n, k, dtype=torch.bfloat16, seed=7) / k**0.5
    torch.testing.assert_close(gemv(x, w).float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=1.6e-2)


def test_gemv_compiles_for_sm90_without_a_gpu():
    """bf16 with bias and without, 1-4 rows, at tile sizes bench/tune_gemv.py sweeps, through Triton's ptxas; and the
    q/k/v projection with RoPE and the store at Llama-3.1-8B's heads as a dependent launch."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_gemv import _gemv_kernel as kernel
names = kernel.arg_names
first_constexpr = names.index("BLOCK_N")
sig = {name: "i32" for name in names[:first_constexpr]}
sig.update({name: "*bf16" for name in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr",
                                        "v_cache_ptr")}, slots_ptr="*i64")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
plain = dict(PDL=False, ROPE=False, HEAD_DIM=2, Q_COLS=0, K_COLS=0, STORE=False)
rope = dict(PDL=True, ROPE=True, HEAD_DIM=128, Q_COLS=4096, K_COLS=1024, STORE=True)
for block_n, block_k, bias, rows, kind in ((4, 1024, False, 1, plain), (8, 1024, True, 1, plain),
                                           (8, 512, False, 2, plain), (16, 256, False, 4, plain),
                                           (4, 1024, False, 1, rope), (4, 1024, True, 2, rope)):
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias, ROWS=rows, **kind)
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 1, "enable_fp_fusion": False})
    assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)


def test_model_through_the_gemv_equals_cublas_path(tiny_llama):
    """TritonLayerOps with gemv_rows 3: decode steps of 3 sequences run the narrow projections through the GEMV (the
    prefill steps stay on F.linear), the decode graphs recaptured on CUDA; greedy tokens equal and logprobs within
    1e-4 of gemv_rows 0 (cuBLAS)."""
    pytest.importorskip("triton")
    from nanovllm import LLM, SamplingParams
    from nanovllm.kernels import triton_gemv

    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7, [12, 13] * 3]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    outputs, calls = {}, []
    original = triton_gemv.gemv
    for rows in (0, 3):
        llm = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, device=DEVICE.type, dtype="float32",
                  attention_backend="triton")
        ops = llm.runner.layer_ops
        ops.gemv_rows = rows
        ops.gemv = lambda *args, **kwargs: calls.append(rows) or original(*args, **kwargs)
        llm.runner.recapture_decode_graphs()
        outputs[rows] = llm.generate(prompts, params, use_tqdm=False)
    assert calls and set(calls) == {3}
    assert [o.token_ids for o in outputs[3]] == [o.token_ids for o in outputs[0]]
    for got, want in zip(outputs[3], outputs[0]):
        for g, w in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g)
