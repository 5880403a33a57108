"""Programmatic dependent launch (Hopper and later): a kernel launched with `launch_pdl` may start while the kernel
before it in the stream is still running, once every program of that one has signalled `let_next_start`. It then
must `wait_for_previous` (the previous kernel done and its writes visible) before it reads anything another kernel
writes and before it writes anything: until then it may only read what no kernel writes (weights). At batch-1
decode a layer is ten small dependent kernels; each start then overlaps the previous kernel's end instead of
following it (the launch gap, and the first weight tile's load in the GEMV).

On by default (`TritonLayerOps(dependent_launch=False)` and the Triton backend's `dependent_launch = False` turn it
off), effective only on CUDA devices of compute capability 9.0+ outside the interpreter.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """True where a launch with `launch_pdl` overlaps: a CUDA device of compute capability 9.0+, compiled kernels."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """Let the next kernel in the stream start (when every program of this one has got here)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """An L2 prefetch hint (`prefetch.global.L2`) for each address of ptrs: nothing is loaded into registers and
    nothing waits for it, and L2 is coherent, so it may run before `wait_for_previous` even for data the previous
    kernel writes (a line it rewrites is read with its new value later). CUDA only (inline PTX): not for the
    interpreter."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)
