"""Launch sizes computed on the host: Triton 3.6's `triton.cdiv` and `triton.next_power_of_2` are constexpr
functions, ~2 us a call from host code on the CPU VM against ~0.06 us for these (an eager mixed step's wrappers
make ~200 calls). `num_sms`: the device's SM count, which launch sizes aim to fill."""
from __future__ import annotations

import functools

import torch

DEFAULT_NUM_SMS = 132  # H100/H200; used when no CUDA device is present (interpreter)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as Triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
