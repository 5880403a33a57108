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


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k,block_k", [(40, 96, 32), (64, 300, 128), (7, 16, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(gemv, rows, n, k, block_k, bias):
    x, w = rand(rows, k, seed=1), rand(n, k, seed=2) / k**0.5
    b = rand(n, seed=3) if bias else None
    got = gemv(x, w, b, block_n=16, block_k=block_k)
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
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        gemv(rand(2, 32), rand(8, 31))
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(rand(32, 2).t(), rand(8, 32))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_bf16_at_llama_shapes(gemv, rows, n, k):
    x, w = rand(rows, k, dtype=torch.bfloat16, seed=6), rand(n, k, dtype=torch.bfloat16, seed=7) / k**0.5
    want = F.linear(x.float(), w.float())
    got = gemv(x, w).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)


def test_gemv_compiles_for_sm90_without_a_gpu():
    """bf16 with bias and without, at the tile sizes bench/tune_gemv.py sweeps, through Triton's ptxas."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_gemv import _gemv_kernel as kernel
names = kernel.arg_names
first_constexpr = names.index("BLOCK_N")
sig = {name: "i32" for name in names[:first_constexpr]}
sig.update(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
for block_n, block_k, bias in ((16, 512, False), (64, 128, True)):
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias, PRECISION="tf32")
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})
    assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)
