"""Attention kernels over the paged KV cache.

`reference` is pure PyTorch (any device) and defines what the kernels must compute; it also holds
`merge_attention_states`, the log-sum-exp merge used to combine partial attention results.
`triton_paged_attention` needs Triton and is imported lazily (see `triton_available`).
"""
from __future__ import annotations

import importlib.util

from nanovllm.kernels.reference import merge_attention_states, paged_attention_reference

__all__ = ["merge_attention_states", "paged_attention_reference", "triton_available"]


def triton_available() -> bool:
    """True when Triton can be imported (the kernels also need a CUDA device or TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None
