"""Fixes for Triton's CPU interpreter (TRITON_INTERPRET=1), applied by every kernel module on import."""
from __future__ import annotations

import os


def _patch_scalar_index() -> None:
    """Triton 3.6's CPU interpreter turns scalars into Python ints with int(ndarray of shape (1,)),
    which numpy >= 2.4 rejects, so `range(tensor_lo, tensor_hi)` fails. Convert via the first element."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_nanovllm_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._nanovllm_patched = True
    interpreter._patch_lang_tensor = patched


def _patch_bfloat16_dot() -> None:
    """The interpreter keeps bfloat16 as its uint16 bits and tl.dot multiplies those bits as integers.
    Widen bfloat16 operands to float32 first (exact: the upper half of a float32's bits)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot
    if getattr(original, "_nanovllm_patched", False):
        return

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    patched._nanovllm_patched = True
    InterpreterBuilder.create_dot = patched


def patch_if_interpreting() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_scalar_index()
        _patch_bfloat16_dot()
