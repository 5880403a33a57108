"""A block-sparse prefill's per-layer tables by one Triton kernel (kernels/triton_group_tables.py) against the
PyTorch path (kv_access.group_tables_reference), at small sizes under Triton's CPU interpreter (no CUDA)."""
from __future__ import annotations

import pytest
import torch
from compiled_helpers import assert_runs_compiled

from nanovllm.layers.kv_access import group_tables_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def group_inputs(groups, heads, columns, width, seed):
    """Masks [G, Hk, C] of about a third of each group's first `width` blocks, ids [G, C] of distinct blocks with
    a fifth not in the pool (-1), and each group's tokens short of its kept blocks (<= 0)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(groups, heads, columns, generator=g) < 0.3
    mask[:, :, width:] = False
    ids = torch.randperm(groups * columns * 2, generator=g)[: groups * columns].view(groups, columns)
    ids[torch.rand(groups, columns, generator=g) < 0.2] = -1
    short = -torch.randint(0, 16, (groups, 1), generator=g)
    return mask, ids, short


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups, heads, columns, width, block_columns", [
    (5, 3, 37, 37, 16),  # three heads padded to four; columns over three loop steps
    (4, 8, 300, 200, 64),  # blocks past the width never kept
    (3, 1, 16, 9, 256),  # one head, one loop step wider than the row (the default)
])
def test_group_tables_equal_the_reference(groups, heads, columns, width, block_columns, causal):
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_group_tables import group_tables

    mask, ids, short = group_inputs(groups, heads, columns, width, seed=groups * columns + width)
    want_tables, want_lengths = group_tables_reference(mask, ids, short if causal else None, width, 16)
    tables, lengths = group_tables(mask.to(DEVICE), ids.to(DEVICE), short.view(-1).to(DEVICE) if causal else None,
                                   width, 16, block_columns=block_columns)
    assert torch.equal(tables.cpu(), want_tables)
    assert torch.equal(lengths.cpu().long(), want_lengths)
    assert (want_tables >= 0).any() and (want_tables == -1).any()


def test_group_tables_take_strided_masks_and_ids():
    """A mask shared by every head (a stride-0 view: the rows of sequences read whole) and ids that are a column
    slice of a wider tensor."""
    pytest.importorskip("triton")
    from nanovllm.kernels.triton_group_tables import group_tables

    mask, ids, short = group_inputs(4, 1, 40, 40, seed=3)
    shared = mask.expand(-1, 4, -1)
    wide = torch.cat([ids, ids], 1)[:, 40:]
    want = group_tables_reference(shared, ids, short, 40, 16)
    got = group_tables(shared.to(DEVICE), wide.to(DEVICE), short.view(-1).to(DEVICE), 40, 16)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu().long(), want[1])


def test_selection_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects: the tables kernel and XAttention's covering kernel
    compiled for sm_90 through Triton's own ptxas (the tables causal or not)."""
    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels import triton_group_tables as gt, triton_xattention as x
target = GPUTarget("cuda", 90, 32)

def signature(kernel, **types):
    return {n: types.get(n) or ("*fp32" if n.endswith("_ptr") else "constexpr" if n.isupper() else "i32")
            for n in kernel.arg_names}

for causal in (True, False):
    sig = signature(gt._group_tables_kernel, mask_ptr="*i1", ids_ptr="*i64", short_ptr="*i64", tables_ptr="*i64",
                    lengths_ptr="*i32")
    assert triton.compile(ASTSource(gt._group_tables_kernel, sig, dict(HEADS_PAD=8, BLOCK_C=256, CAUSAL=causal)),
                          target=target, options={"num_warps": 4})
sig = signature(x._covering_kernel, keep_ptr="*i1", threshold="fp32")
assert triton.compile(ASTSource(x._covering_kernel, sig, dict(BLOCK_C=1024)), target=target, options={"num_warps": 4})
print("ok")
"""
    assert_runs_compiled(code, timeout=300)
