"""Dependent launches (kernels/dependent_launch.py) of the GEMV, RMSNorm, SiLU * up, RoPE, decode attention and merge
kernels.

Any machine: compiled for sm_90 through Triton's own ptxas, a dependent kernel's PTX waits for the previous kernel
(`griddepcontrol.wait`) and lets the next start (`griddepcontrol.launch_dependents`), the GEMV's first weight tile
loaded before the wait and x after it; without it neither instruction. Off the GPU (the interpreter, the CPU) the
option is a no-op. On CUDA: a model with dependent launches, its decode steps in CUDA graphs, greedy-equal to one
without them.
"""
from __future__ import annotations

import pytest
import torch

from compiled_helpers import assert_runs_compiled

CUDA = torch.cuda.is_available()


def test_supported_only_on_compiled_cuda_kernels(monkeypatch):
    pytest.importorskip("triton")
    from nanovllm.kernels import dependent_launch

    assert not dependent_launch.supported(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dependent_launch.supported(torch.device("cuda", 0))


def test_dependent_kernels_wait_and_let_the_next_start_in_sm90_code():
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_fused import _qk_norm_rope_kernel, _rms_norm_kernel, _silu_and_mul_kernel
from nanovllm.kernels.triton_gemv import _gemv_kernel
from nanovllm.kernels.triton_paged_attention import _decode_kernel, _merge_splits_kernel

def ptx(kernel, pointers, first_constexpr, consts, **types):
    names = kernel.arg_names
    sig = {name: "i32" for name in names[:names.index(first_constexpr)]}
    sig.update({name: "*bf16" for name in pointers}, **types)
    sig.update({name: "constexpr" for name in names[names.index(first_constexpr):]})
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "enable_fp_fusion": False})
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]

rope_pointers = ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr", "v_ptr",
                 "k_cache_ptr", "v_cache_ptr")
for pdl, early in ((False, False), (True, False), (True, True)):
    codes = {
        "gemv": ptx(_gemv_kernel, ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr",
                                   "v_cache_ptr"), "BLOCK_N",
                    dict(BLOCK_N=4, BLOCK_K=1024, HAS_BIAS=False, ROWS=1, PDL=pdl, ROPE=early, HEAD_DIM=128,
                         Q_COLS=4096, K_COLS=1024, STORE=early), slots_ptr="*i64"),
        "rms_norm": ptx(_rms_norm_kernel, ("x_ptr", "res_ptr", "out_ptr", "res_out_ptr", "w_ptr"), "HAS_RESIDUAL",
                        dict(HAS_RESIDUAL=True, BLOCK=4096, PDL=pdl), eps="fp32"),
        "silu": ptx(_silu_and_mul_kernel, ("x_ptr", "out_ptr"), "BLOCK", dict(BLOCK=1024, PDL=pdl)),
        "rope": ptx(_qk_norm_rope_kernel, rope_pointers, "NUM_Q_HEADS",
                    dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HEAD_DIM=128, HAS_NORM=False, STORE=True, Q_HEADS_PAD=32,
                         K_HEADS_PAD=8, PDL=pdl), slots_ptr="*i64", eps="fp32"),
        "decode": ptx(_decode_kernel, ("q_ptr", "k_cache_ptr", "v_cache_ptr", "codes_ptr", "scales_ptr"), "GROUP",
                      dict(GROUP=4, GROUP_PAD=16, BLOCK_SIZE=256, HEAD_DIM=128, BLOCK_N=64, INDEXED=False,
                           DIRECT=False, PRECISION="tf32", ACCUMULATE=False, HOST_KV=False, PER_HEAD=False,
                           KEY_CODES=False, PDL=pdl, EARLY=early),
                      out_ptr="*fp32", lse_ptr="*fp32", cu_ptr="*i32", seq_lens_ptr="*i32", tables_ptr="*i32",
                      seq_ids_ptr="*i32", qk_scale="fp32"),
        "merge": ptx(_merge_splits_kernel, ("out_ptr",), "HEAD_DIM",
                     dict(HEAD_DIM=128, INDEXED=False, ACCUMULATE=False, PDL=pdl, EARLY=early), part_out_ptr="*fp32",
                     part_lse_ptr="*fp32", lse_ptr="*fp32", cu_ptr="*i32", seq_ids_ptr="*i32", seq_lens_ptr="*i32"),
    }
    for name, code in codes.items():
        has = ("griddepcontrol.wait" in code, "griddepcontrol.launch_dependents" in code)
        assert has == (pdl, pdl), (name, pdl, has)
    if pdl:  # the GEMV's first weight tile is loaded before the wait, x after it
        gemv = codes["gemv"]
        wait = gemv.index("griddepcontrol.wait")
        assert "ld.global" in gemv[:wait], "no load before the wait"
        for name in ("decode", "merge"):
            before = codes[name][:codes[name].index("griddepcontrol.wait")]
            if early:  # the host's lengths and tables read before the wait, the first KV tiles prefetched into L2
                assert "ld.global" in before, name
                assert ("prefetch.global.L2" in before) == (name == "decode"), name
            else:  # every input may be the previous kernel's output: nothing read before
                assert "ld.global" not in before and "prefetch" not in before, name
print("ok")
"""
    assert_runs_compiled(code, timeout=300)


def test_dependent_launch_off_the_gpu_changes_nothing(tiny_llama):
    """TritonLayerOps(dependent_launch=True) where no kernel can launch dependently (the interpreter, the CPU):
    the same greedy tokens and logprobs as without."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("the CUDA test below covers it")
    _assert_same_greedy(tiny_llama, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_dependent_launch_keeps_greedy_tokens_in_cuda_graphs(tiny_llama):
    """Decode steps of 1 and 3 sequences in CUDA graphs with dependent launches (the GEMV at up to 3 rows): greedy
    tokens equal and logprobs within 1e-4 of the same engine without them."""
    _assert_same_greedy(tiny_llama, "cuda")


def _assert_same_greedy(model, device: str) -> None:
    from nanovllm import LLM, SamplingParams

    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7, [12, 13] * 3]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outputs = {}
    for dependent in (False, True):
        llm = LLM(str(model), kvcache_block_size=16, num_gpu_blocks=64, device=device, dtype="float32",
                  attention_backend="triton")
        ops = llm.runner.layer_ops
        ops.gemv_rows, ops.dependent_launch = 3, dependent
        llm.runner.backend.dependent_launch = dependent
        llm.runner.recapture_decode_graphs()
        outputs[dependent] = llm.generate(prompts, params, use_tqdm=False) + \
            llm.generate(prompts[:1], params, use_tqdm=False)
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    for got, want in zip(outputs[True], outputs[False]):
        for g, w in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g)


def test_the_bench_switch_sets_both_kernel_sets_before_the_first_request_only(tiny_llama):
    """Benches' --no-dependent-launch (bench/common.set_layer_ops): the layer ops and the attention backend both switch
    (the decode and merge kernels are the backend's); after a request it refuses (its warm-up steps write the first
    blocks of the pool, which requests may hold by then)."""
    pytest.importorskip("triton")
    import sys
    from pathlib import Path

    from nanovllm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from common import set_layer_ops

    llm = LLM(str(tiny_llama), kvcache_block_size=16, num_gpu_blocks=64, device="cpu", dtype="float32",
              attention_backend="triton")
    assert llm.runner.layer_ops.dependent_launch and llm.runner.backend.dependent_launch  # the default
    set_layer_ops(llm, None, False)
    assert not llm.runner.layer_ops.dependent_launch and not llm.runner.backend.dependent_launch
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(SystemExit, match="before the engine's first request"):
        set_layer_ops(llm, 2, True)
