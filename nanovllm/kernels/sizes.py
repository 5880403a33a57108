"""Launch sizes computed on the host: Triton 3.6's `triton.cdiv` and `triton.next_power_of_2` are constexpr
functions, ~2 us a call from host code on the CPU VM against ~0.06 us for these (an eager mixed step's wrappers
make ~200 calls)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as Triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
