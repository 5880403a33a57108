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


@pytest.mark.parametrize("rows,use_dot", [(1, True), (3, True), (16, True), (1, False), (3, False)])
@pytest.mark.parametrize("n,k,block_k", [(40, 96, 32), (64, 300, 128), (7, 16, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(gemv, rows, use_dot, n, k, block_k, bias):
    x, w = rand(rows, k, seed=1), rand(n, k, seed=2) / k**0.5
    b = rand(n, seed=3) if bias else None
    got = gemv(x, w, b, block_n=16 if use_dot else 8, block_k=block_k, use_dot=use_dot)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_gemv_reads_strided_rows_and_only_its_rows(gemv):
    """x a column slice of a wider tensor (row stride > K); rows past M hold NaN in memory the kernel must not
    mix in (it pads to 16 rows with zeros)."""
    wide = torch.full((16, 200), float("nan"), device=DEVICE)
    wide[:2, :80] = rand(2, 80, seed=4)
    x = wide[:2, :80]
    w = rand(48, 80, seed=5)
    torch.testing.assert_close(gemv(x, w, block_n=16, block_k=32), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_errors_name_the_limit(gemv):
    with pytest.raises(ValueError, match="1..16 rows"):
        gemv(rand(17, 32), rand(8, 32))
    with pytest.raises(ValueError, match="1..4 rows without tl.dot"):
        gemv(rand(5, 32), rand(8, 32), use_dot=False)
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        gemv(rand(2, 32), rand(8, 31))
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(rand(32, 2).t(), rand(8, 32))


@pytest.mark.parametrize("rows,use_dot", [(1, True), (5, True), (3, False)])
@pytest.mark.parametrize("k,block_k", [(96, 32), (200, 64)])
def test_gemv_with_the_layer_op_before_it_fused(gemv, rows, use_dot, k, block_k):
    """The product of LayerOps' SiLU * up, RMSNorm, or residual add + RMSNorm (also returning the sum) of x, as the
    separate op then F.linear compute it."""
    from nanovllm.layers.fused_ops import LayerOps

    ops, w = LayerOps(), rand(48, k, seed=8) / k**0.5
    launch = dict(block_n=16, block_k=block_k, use_dot=use_dot)
    gate_up = rand(rows, 2 * k, seed=9) * 3
    torch.testing.assert_close(gemv(gate_up, w, **launch, silu_mul=True),
                               F.linear(ops.silu_and_mul(gate_up), w), atol=1e-5, rtol=1e-5)
    x, residual, norm_weight = rand(rows, k, seed=10) * 2, rand(rows, k, seed=11), rand(k, seed=12) * 0.2 + 1
    torch.testing.assert_close(gemv(x, w, **launch, norm=(norm_weight, 1e-6)),
                               F.linear(ops.rms_norm(x, norm_weight, 1e-6), w), atol=1e-5, rtol=1e-5)
    got, summed = gemv(x, w, **launch, norm=(norm_weight, 1e-6), residual=residual)
    normed, want_sum = ops.add_rms_norm(x, residual, norm_weight, 1e-6)
    torch.testing.assert_close(got, F.linear(normed, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(summed, want_sum)


def test_gemv_prologue_errors(gemv):
    with pytest.raises(ValueError, match="x \\[M, 2K\\]"):
        gemv(rand(2, 32), rand(8, 32), silu_mul=True)
    with pytest.raises(ValueError, match="one prologue"):
        gemv(rand(2, 64), rand(8, 32), silu_mul=True, norm=(rand(32), 1e-6))
    with pytest.raises(ValueError, match="one prologue"):
        gemv(rand(2, 32), rand(8, 32), residual=rand(2, 32))
    with pytest.raises(ValueError, match="shaped as x"):
        gemv(rand(2, 32), rand(8, 32), norm=(rand(32), 1e-6), residual=rand(3, 32))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows,use_dot", [(1, True), (4, True), (16, True), (1, False), (4, False)])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_bf16_at_llama_shapes(gemv, rows, use_dot, n, k):
    from nanovllm.layers.fused_ops import get_layer_ops

    x, w = rand(rows, k, dtype=torch.bfloat16, seed=6), rand(n, k, dtype=torch.bfloat16, seed=7) / k**0.5
    launch = dict(use_dot=True) if use_dot else dict(use_dot=False, block_n=8, block_k=512)
    torch.testing.assert_close(gemv(x, w, **launch).float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=1.6e-2)
    ops = get_layer_ops("triton")
    gate_up = rand(rows, 2 * k, dtype=torch.bfloat16, seed=8)
    torch.testing.assert_close(gemv(gate_up, w, **launch, silu_mul=True).float(),
                               F.linear(ops.silu_and_mul(gate_up).float(), w.float()), atol=2e-2, rtol=1.6e-2)
    residual, norm_weight = rand(rows, k, dtype=torch.bfloat16, seed=9), rand(k, dtype=torch.bfloat16, seed=10)
    got, summed = gemv(x, w, **launch, norm=(norm_weight, 1e-5), residual=residual)
    normed, want_sum = ops.add_rms_norm(x, residual, norm_weight, 1e-5)
    torch.testing.assert_close(got.float(), F.linear(normed.float(), w.float()), atol=2e-2, rtol=1.6e-2)
    assert torch.equal(summed, want_sum)


def test_gemv_compiles_for_sm90_without_a_gpu():
    """bf16 with bias and without, each prologue, at tile sizes bench/tune_gemv.py sweeps, through Triton's ptxas."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_gemv import _gemv_kernel as kernel
names = kernel.arg_names
first_constexpr = names.index("BLOCK_N")
sig = {name: "i32" for name in names[:first_constexpr]}
sig.update({name: "*bf16" for name in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr", "res_out_ptr", "norm_ptr")})
sig.update(eps="fp32")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
for block_n, block_k, bias, prologue, residual, rows in ((16, 512, False, 0, False, 16), (64, 128, True, 0, False, 16),
                                                        (32, 256, False, 1, False, 16), (32, 256, False, 2, True, 16),
                                                        (16, 128, False, 2, False, 16), (8, 512, False, 0, False, 1),
                                                        (4, 1024, False, 2, True, 4), (8, 512, False, 1, False, 2)):
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias, PRECISION="tf32", PROLOGUE=prologue,
                  HAS_RESIDUAL=residual, ROWS=rows, USE_DOT=rows == 16)
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3, "enable_fp_fusion": False})
    assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)


def test_model_through_the_gemv_equals_cublas_path(tiny_llama):
    """TritonLayerOps with gemv_rows set: steps of that many rows or fewer run every one-rank projection through the
    GEMV with its norm or SiLU * up fused in (decode steps of 3 sequences here; the prefill steps stay on
    F.linear), the decode graphs recaptured on CUDA; greedy tokens equal and logprobs within 1e-4 of the default."""
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
