"""Gather KV blocks from pinned host memory into a device staging slot, as a kernel.

A copy engine needs the addresses when the copy is enqueued, so a CUDA graph cannot replay a host->device
copy whose blocks change from step to step. This kernel instead reads its list of source blocks from a
device tensor, and the host blocks themselves through unified addressing (pinned memory is mapped into
the device's address space), so the step's copies can be captured once and replayed with new lists.
`reference.gather_blocks_reference` is the same operation in PyTorch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

CHUNK = 8192  # elements per program


@triton.jit
def _gather_kernel(dst_ptr, sources_ptr, src_delta_k, src_delta_v, dst_stride_kv, block_elems,
                   CHUNK: tl.constexpr):
    """Program (position, kv, chunk): copy one chunk of block sources[position] (skipped when -1) from the
    source pool (src_delta_* elements away from dst) to block `position` of the destination."""
    position = tl.program_id(0)
    kv = tl.program_id(1)
    source = tl.load(sources_ptr + position)
    if source >= 0:
        offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < block_elems
        dst = dst_ptr + kv * dst_stride_kv + position.to(tl.int64) * block_elems
        delta = tl.where(kv == 0, src_delta_k, src_delta_v - dst_stride_kv)
        src = dst_ptr + kv * dst_stride_kv + delta + source * block_elems
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _check(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor) -> None:
    for t in (dst_k, dst_v, src_k, src_v):
        if not t.is_contiguous() or t.shape[1:] != dst_k.shape[1:] or t.dtype != dst_k.dtype:
            raise ValueError("gather_blocks needs contiguous pools of one dtype and block shape")
    if dst_k.is_cuda and not (src_k.is_pinned() and src_v.is_pinned()):
        raise ValueError("the source pools of a CUDA gather must be in pinned host memory")


def gather_blocks(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                  sources: torch.Tensor) -> None:
    """dst_*[p] = src_*[sources[p]] for every position p with sources[p] >= 0 (others untouched).
    dst_*: device pools [n, ...]; src_*: pinned host pools with the same block shape; sources: int64 [n]
    on the device."""
    _check(dst_k, dst_v, src_k, src_v)
    size = dst_k.element_size()
    block_elems = dst_k[0].numel()
    stride_kv = (dst_v.data_ptr() - dst_k.data_ptr()) // size
    grid = (sources.shape[0], 2, triton.cdiv(block_elems, CHUNK))
    _gather_kernel[grid](dst_k, sources, (src_k.data_ptr() - dst_k.data_ptr()) // size,
                         (src_v.data_ptr() - dst_k.data_ptr()) // size, stride_kv, block_elems, CHUNK=CHUNK)
