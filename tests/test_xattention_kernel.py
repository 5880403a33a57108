"""XAttention's fused estimate and its softmax-granule-sums kernel (kernels/triton_xattention.py) against the
PyTorch path of XAttentionSelector.granule_mass (their reference), at small sizes under Triton's CPU interpreter (no CUDA):
the granule masses to float32 tolerance and the selections made from them equal."""
from __future__ import annotations

import pytest
import torch
from compiled_helpers import assert_runs_compiled

from nanovllm.layers.xattention import XAttentionSelector

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# seq_len, n_q (a first query mid-tile where seq_len - n_q is no multiple of the stride), stride, granule,
# KV heads, group, head_dim
SHAPES = [(200, 200, 4, 16, 2, 2, 16), (301, 123, 8, 32, 1, 4, 32), (450, 77, 4, 16, 2, 1, 64),
          (700, 333, 8, 16, 1, 4, 16), (512, 256, 8, 32, 2, 2, 32),  # whole tiles, the inputs in place
          (260, 130, 4, 16, 1, 2, 128)]  # Llama-3.1-8B's head_dim: two reduction steps a row in 16-bit


def inputs(seq_len, n_q, kv_heads, group, dim, dtype):
    g = torch.Generator().manual_seed(seq_len + n_q)
    keys = torch.randn(seq_len, kv_heads, dim, generator=g) * 2
    q = torch.randn(n_q, kv_heads * group, dim, generator=g) * 2
    return q.to(dtype), keys.to(dtype)


def selector(stride, granule, cover, fused):
    s = XAttentionSelector(None, None, threshold=0.8, stride=stride, block_size=granule, min_context=0, cover=cover)
    s.fused_estimate = fused
    return s


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq_len, n_q, stride, granule, kv_heads, group, dim", SHAPES)
def test_kernel_masses_equal_the_reference(seq_len, n_q, stride, granule, kv_heads, group, dim, dtype, atol):
    """The kernel on (bf16) inputs against the reference on the same values in float32; blocks of 16 tiles
    (several query and key blocks per head at these sizes, rows' key blocks split over programs in pairs)."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_xattention import EstimateConfig, estimate_granule_mass

    q, keys = inputs(seq_len, n_q, kv_heads, group, dim, dtype)
    want, first = selector(stride, granule, "head", False).granule_mass(q.float(), keys.float(), granule)
    got = estimate_granule_mass(q.to(DEVICE), keys.to(DEVICE), stride, granule, first * granule, seq_len,
                                EstimateConfig(16, 16, split_blocks=2, num_warps=4, num_stages=2)).cpu()
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


def test_kernel_reads_queries_in_place_from_a_wider_projection():
    """Queries as the model has them, a view of the fused q/k/v projection's output (rows wider than the query
    heads): the kernel reads them through a descriptor in place and its masses equal those of a contiguous copy,
    and of the reference; keys ending mid-tile take the padded copy."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_xattention import EstimateConfig, estimate_granule_mass, tile_rows

    q, keys = inputs(512, 256, 2, 2, 32, torch.float32)
    qkv = torch.cat([q.flatten(1), keys[-256:].flatten(1), keys[-256:].flatten(1)], 1).to(DEVICE)
    in_place = qkv[:, : 4 * 32].view(256, 4, 32)
    assert tile_rows(in_place, 0, 8)[0].data_ptr() == in_place.data_ptr()
    config = EstimateConfig(block_m=16, block_n=16, split_blocks=2, num_warps=4, num_stages=2)
    got = estimate_granule_mass(in_place, keys.to(DEVICE), 8, 32, 256, 512, config)
    torch.testing.assert_close(got, estimate_granule_mass(q.to(DEVICE), keys.to(DEVICE), 8, 32, 256, 512, config))
    want, first = selector(8, 32, "head", False).granule_mass(q, keys, 32)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
    assert tile_rows(keys[:509], 0, 8)[0].shape == (512, 2 * 32)


def test_shapes_the_kernel_does_not_take_run_the_torch_path():
    """A head_dim of 24 (no reduction step divides it) and a stride of 3: the selector asked for the Triton
    estimate makes its masses through the PyTorch path, equal to the reference."""
    for stride, granule, dim in ((4, 16, 24), (3, 12, 16)):
        q, keys = inputs(300, 100, 1, 2, dim, torch.float32)
        fused = selector(stride, granule, "head", True)
        assert fused._fused_estimate(q, granule) is None
        got, _ = fused.granule_mass(q, keys, granule)
        torch.testing.assert_close(got, selector(stride, granule, "head", False).granule_mass(q, keys, granule)[0])


@pytest.mark.parametrize("cover", ["head", "group"])
@pytest.mark.parametrize("seq_len, n_q, stride, granule, kv_heads, group, dim", SHAPES[1:3])
def test_selection_through_the_kernel_equals_the_torch_path(seq_len, n_q, stride, granule, kv_heads, group, dim,
                                                            cover):
    """granule_mass in query chunks of 64 tokens through the kernel (the default blocks) and through
    the PyTorch path: the same masses, and sequence_selection keeps the same blocks (KV block 2 granules)."""
    pytest.importorskip("triton")
    q, keys = inputs(seq_len, n_q, kv_heads, group, dim, torch.float32)
    fused, reference = selector(stride, granule, cover, True), selector(stride, granule, cover, False)
    got, first = fused.granule_mass(q.to(DEVICE), keys.to(DEVICE), granule, chunk=64)
    want, first_reference = reference.granule_mass(q, keys, granule, chunk=64)
    assert first == first_reference
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
    kept = fused.sequence_selection(q.to(DEVICE), keys.to(DEVICE), 2 * granule).cpu()
    assert torch.equal(kept, reference.sequence_selection(q, keys, 2 * granule))
    assert not kept.all()


def test_forced_blocks_through_the_kernel_equal_the_torch_path():
    """select() on a chunk before the prompt's end, with xattn_dense_last_blocks and xattn_local_blocks: the
    fused estimate and the PyTorch one keep the same blocks, the prompt's last query blocks every visible one."""
    pytest.importorskip("triton")
    from nanovllm.engine.kv_cache import PagedKVCache
    from nanovllm.layers.block_selector import SelectionInput

    seq_len, n_q, prompt_len, kb = 301, 123, 340, 32
    q, keys = inputs(seq_len, n_q, 1, 4, 32, torch.float32)
    cache = PagedKVCache(1, 12, kb, 1, 32, torch.float32, DEVICE)
    cache.write(0, keys.to(DEVICE), keys.to(DEVICE), torch.arange(seq_len, device=DEVICE))
    batch = SelectionInput([n_q], [seq_len], kb, [list(range(10))], prefill_ends=[prompt_len])
    kept = []
    for fused in (True, False):
        s = XAttentionSelector(cache, None, 0.3, 8, 32, 0, dense_last_blocks=3, local_blocks=1)
        s.fused_estimate = fused
        kept.append(s.select(0, q.to(DEVICE), 1, batch)[0].cpu())
    assert torch.equal(kept[0], kept[1])
    first = (seq_len - n_q) // kb
    assert kept[0][:, 8 - first, :9].all() and kept[0][:, 9 - first, :10].all()  # blocks 8-9: tokens 256-340
    assert not kept[0][:, 7 - first, :8].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_columns", [1024, 256, 16])  # 1024: the default
@pytest.mark.parametrize("heads, tiles, columns, lead, tiles_per_granule, spread",
                         [(3, 40, 100, 0, 4, 3), (2, 33, 77, 3, 8, 3), (4, 16, 300, 0, 16, 3), (1, 5, 9, 1, 2, 3),
                          (2, 24, 200, 0, 8, 300)])
def test_softmax_granule_sums_equal_the_torch_path(heads, tiles, columns, lead, tiles_per_granule, spread,
                                                   block_columns, dtype):
    """The kernel's softmax and granule sums of causally masked scores (the chunk's tiles see the columns up to
    their own) equal the PyTorch path's softmax, zero padding and sums: a lead of zero tiles, ragged last
    granules, blocks of columns narrower and wider than the row, scores far apart (a row's running max moves by
    hundreds between blocks of columns: what came before must be rescaled, neither overflowing nor lost)."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_xattention import softmax_granule_sums

    g = torch.Generator().manual_seed(tiles + columns)
    scores = (torch.randn(heads, tiles, columns, generator=g) * spread).to(dtype).float()
    hidden = torch.arange(columns)[None, :] > columns - tiles + torch.arange(tiles)[:, None]
    scores.masked_fill_(hidden, float("-inf"))
    rows, key_granules = -(-(lead + tiles) // tiles_per_granule), -(-columns // tiles_per_granule)
    want = selector(4, 4 * tiles_per_granule, "head", False)._granule_sums(scores[:, None], lead, rows, key_granules,
                                                                            tiles_per_granule)
    got = softmax_granule_sums(scores.to(dtype).to(DEVICE), lead, rows, key_granules, tiles_per_granule,
                               block_columns).cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.allclose(got.sum((1, 2)), torch.full((heads,), float(tiles)))  # each tile row's mass is one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the selector takes the kernel for CUDA queries only")
@pytest.mark.parametrize("cover", ["head", "group"])
def test_granule_mass_through_the_sums_kernel_equals_the_torch_path(cover):
    """granule_mass with fused_granule_sums (bf16 scores, float32 sums in the kernel) against the PyTorch path
    on the same inputs; selections equal but for near ties."""
    q, keys = inputs(700, 333, 2, 4, 64, torch.bfloat16)
    fused, reference = selector(8, 32, cover, False), selector(8, 32, cover, False)
    fused.fused_granule_sums = True
    got, first = fused.granule_mass(q.to(DEVICE), keys.to(DEVICE), 32, chunk=128)
    want, first_reference = reference.granule_mass(q.to(DEVICE), keys.to(DEVICE), 32, chunk=128)
    assert first == first_reference
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # the PyTorch path rounds probabilities to bf16
    kept = fused.sequence_selection(q.to(DEVICE), keys.to(DEVICE), 64)
    assert float((kept == reference.sequence_selection(q.to(DEVICE), keys.to(DEVICE), 64)).float().mean()) > 0.99


@pytest.mark.parametrize("kv_block, xattn_block, stride", [(16, 16, 4), (16, 64, 8), (256, 128, 16)])
def test_warm_up_runs_the_sums_kernel_variant_a_prefill_runs(monkeypatch, kv_block, xattn_block, stride):
    """XAttentionSelector.warm_up (the engine's start-up) calls the granule-sums kernel with the scores' dtype and
    tiles per granule of a sparse prefill's selection, so that no request compiles it (the H200's compile watch
    caught the first xattention prefill compiling it). The kernel is recorded, not run: any device."""
    calls = []

    def recorded(scores, lead, rows, key_granules, tiles_per_granule):
        calls.append((scores.dtype, tiles_per_granule))
        return torch.zeros(scores.shape[0], rows, key_granules)

    monkeypatch.setattr(XAttentionSelector, "_granule_sums_kernel", lambda self, q, granule: recorded)
    cache = type("Cache", (), {"data": torch.zeros(2, 1, 1, kv_block, 2, 16, dtype=torch.bfloat16)})()
    s = XAttentionSelector(cache, None, threshold=0.8, stride=stride, block_size=xattn_block, min_context=0)
    s.warm_up(2, torch.device("cpu"))
    warmed = calls[:]
    q, keys = inputs(3 * max(kv_block, xattn_block), 2 * max(kv_block, xattn_block), 2, 2, 16, torch.bfloat16)
    s.sequence_selection(q, keys, kv_block)
    assert len(warmed) == 1 and calls[1:] and set(calls[1:]) == set(warmed)


def test_warm_up_runs_the_estimate_variant_a_prefill_runs(monkeypatch):
    """With the Triton estimate on, XAttentionSelector.warm_up calls it with the dtype, head_dim, stride and
    granule of a sparse prefill's selection (the kernel's compiled variant: every integer argument is unspecialised,
    the group too), not the granule-sums kernel. Recorded, not run."""
    calls = []

    def recorded(q, keys, stride, granule, lo, hi):
        calls.append((q.dtype, q.shape[-1], stride, granule))
        return torch.zeros(q.shape[1], -(-(hi - lo) // granule), -(-keys.shape[0] // granule))

    monkeypatch.setattr(XAttentionSelector, "_fused_estimate", lambda self, q, granule: recorded)
    monkeypatch.setattr(XAttentionSelector, "_granule_sums_kernel", lambda self, q, granule: pytest.fail("sums"))
    cache = type("Cache", (), {"data": torch.zeros(2, 1, 1, 32, 2, 16, dtype=torch.bfloat16)})()
    s = XAttentionSelector(cache, None, threshold=0.8, stride=4, block_size=16, min_context=0)
    s.warm_up(2, torch.device("cpu"))
    q, keys = inputs(96, 64, 2, 2, 16, torch.bfloat16)
    s.sequence_selection(q, keys, 32)
    assert len(calls) == 2 and calls[0] == calls[1] == (torch.bfloat16, 16, 4, 32)


def test_the_triton_estimate_is_the_default_for_16_bit_cuda_queries_only():
    """fused_estimate None (the default): the Triton estimate for bf16 / fp16 queries on CUDA, the PyTorch path for
    float32 ones and on the CPU; True takes it on the CPU too (Triton's interpreter), False nowhere."""
    s = selector(4, 16, "head", None)
    assert s._fused_estimate(torch.zeros(1, 2, 16, dtype=torch.bfloat16), 16) is None
    if torch.cuda.is_available():
        assert s._fused_estimate(torch.zeros(1, 2, 16, dtype=torch.bfloat16, device="cuda"), 16) is not None
        assert s._fused_estimate(torch.zeros(1, 2, 16, device="cuda"), 16) is None
    assert selector(4, 16, "head", True)._fused_estimate(torch.zeros(1, 2, 16), 16) is not None
    assert selector(4, 16, "head", False)._fused_estimate(torch.zeros(1, 2, 16, dtype=torch.bfloat16), 16) is None


def test_estimate_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects: the estimate's two kernels compiled for sm_90 through
    Triton's own ptxas, at the default launch (128 x 256 tiles, 8 warps, 3 stages: within Hopper's shared memory)
    and the smaller one, Llama-3.1-8B's head_dim 128 and SmolLM2's 64, bf16."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels import triton_xattention as x
target = GPUTarget("cuda", 90, 32)

def signature(kernel, **types):
    sig = {}
    for name in kernel.arg_names:
        sig[name] = types.get(name) or ("*fp32" if name.endswith("_ptr") else "constexpr" if name.isupper() else "i32")
    return sig

for config in (x.EstimateConfig(), x.EstimateConfig(block_n=128, split_blocks=4, num_stages=2)):
    for dim in (128, 64):
        sig = signature(x._estimate_kernel, q_desc=f"tensordesc<bf16[{config.block_m},64]>",
                        k_desc=f"tensordesc<bf16[{config.block_n},64]>", scale_log2="fp32")
        consts = dict(STRIDE=16, HEAD_DIM=dim, BLOCK_K=64, TILES_PER_GRANULE=16, BLOCK_M=config.block_m,
                      BLOCK_N=config.block_n, SPLIT_BLOCKS=config.split_blocks, PRECISION="tf32",
                      NUM_STAGES=config.num_stages)
        compiled = triton.compile(ASTSource(x._estimate_kernel, sig, consts), target=target,
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    consts = dict(STRIDE=16, TILES_PER_GRANULE=16, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  SPLIT_BLOCKS=config.split_blocks)
    kernel = x._estimate_epilogue_kernel
    assert triton.compile(ASTSource(kernel, signature(kernel), consts), target=target, options={"num_warps": 4})
print("ok")
"""
    assert_runs_compiled(code, timeout=300)
