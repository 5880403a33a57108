"""Variants of the Triton prefill kernel's inner loop, made as copies of nanovllm/kernels/triton_paged_attention.py
with one part of the source replaced (a probe: only what wins goes into the kernel). `load(name)` imports a variant
as its own module (its own JIT functions, so Triton's cache cannot hand back another variant's binary).

  base     the kernel as it is
  exp16    p = 2^x in 16 bits (`ex2.approx.ftz.bf16x2` / `ex2.approx.f16x2`: two exponentials per MUFU op, x
           rounded to the value dtype first), the row sum from those 16-bit p
  noexp    no exponential at all (p = max(x + 1, 0)): wrong results, the bound on what cheaper exponentials can give
  pipe     the next tile's q.k issued before this tile's softmax (FA3's intra-warpgroup overlap, if Triton keeps the
           wgmma in flight across the softmax)
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

SOURCE = pathlib.Path(__file__).resolve().parents[3] / "nanovllm/kernels/triton_paged_attention.py"

SOFTMAX_OLD = """    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
"""
EXP16 = """    p = _exp2_16(qk * qk_scale - m_new[:, None], v.dtype)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
"""
EXP16_HELPER = '''

@triton.jit
def _exp2_16(x, dtype: tl.constexpr):
    """2^x of float32 x in dtype (bfloat16 / float16), two per instruction; float32 falls back to exp2."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    elif dtype == tl.float16:
        return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)],
                                         dtype=tl.float16, is_pure=True, pack=2)
    else:
        return tl.exp2(x).to(dtype)


@triton.jit
def _online_softmax_step('''
NOEXP = """    p = tl.maximum(qk * qk_scale - m_new[:, None] + 1.0, 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
"""
TMA_LOOP_OLD = """    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_N
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int32)  # descriptors take int32 offsets
        row = block * BLOCK_SIZE + start % BLOCK_SIZE
        k = k_desc.load([row, head_col])
        v = v_desc.load([row, head_col])
        qk = tl.dot(q, k.T, input_precision=PRECISION)
        if MASKED:
"""
TMA_LOOP_PIPE = """    offs_n = tl.arange(0, BLOCK_N)
    first = tl.minimum(tile_lo, tl.maximum(tile_hi - 1, 0)) * BLOCK_N
    block = tl.load(table_ptr + first // BLOCK_SIZE).to(tl.int32)
    k = k_desc.load([block * BLOCK_SIZE + first % BLOCK_SIZE, head_col])
    qk_next = tl.dot(q, k.T, input_precision=PRECISION)
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_N
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int32)  # descriptors take int32 offsets
        row = block * BLOCK_SIZE + start % BLOCK_SIZE
        v = v_desc.load([row, head_col])
        qk = qk_next
        after = tl.minimum(tile + 1, tile_hi - 1) * BLOCK_N
        block_after = tl.load(table_ptr + after // BLOCK_SIZE).to(tl.int32)
        k = k_desc.load([block_after * BLOCK_SIZE + after % BLOCK_SIZE, head_col])
        qk_next = tl.dot(q, k.T, input_precision=PRECISION)
        if MASKED:
"""

VARIANTS = {
    "base": [],
    "exp16": [(SOFTMAX_OLD, EXP16), ("\n\n@triton.jit\ndef _online_softmax_step(", EXP16_HELPER)],
    "noexp": [(SOFTMAX_OLD, NOEXP)],
    "pipe": [(TMA_LOOP_OLD, TMA_LOOP_PIPE)],
    "pipe_exp16": [(TMA_LOOP_OLD, TMA_LOOP_PIPE), (SOFTMAX_OLD, EXP16),
                   ("\n\n@triton.jit\ndef _online_softmax_step(", EXP16_HELPER)],
}
_DIR = pathlib.Path(tempfile.mkdtemp(prefix="prefill_variants_"))


def source(name: str) -> str:
    text = SOURCE.read_text()
    for old, new in VARIANTS[name]:
        if text.count(old) != 1:
            raise ValueError(f"variant {name}: the replaced text occurs {text.count(old)} times")
        text = text.replace(old, new)
    return text


def load(name: str):
    path = _DIR / f"pa_{name}.py"
    path.write_text(source(name))
    spec = importlib.util.spec_from_file_location(f"pa_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton's JIT reads the module's globals through sys.modules
    spec.loader.exec_module(module)
    return module
