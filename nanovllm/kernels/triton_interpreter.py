"""A fix for Triton's CPU interpreter (TRITON_INTERPRET=1), applied by every kernel module on import."""
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



def patch_if_interpreting() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_scalar_index()
