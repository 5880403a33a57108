"""Device, dtype and attention-backend choice, and how many KV blocks fit in the device's budget."""
from __future__ import annotations

from collections.abc import Callable

import torch

from nanovllm.config import EngineConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available on this machine")
    return torch.device(name)


def resolve_backend(name: str, device: torch.device) -> str:
    """'auto': Triton kernels on CUDA when Triton is installed, else the pure-PyTorch path."""
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            pass
    return "torch"


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and less accurate
    stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return torch.float16 if stored == "float16" else torch.bfloat16


def readable_size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def kv_blocks_that_fit(config: EngineConfig, device: torch.device, bytes_per_block: int, reserved: int,
                       peak_activations: Callable[[], int], reserved_for: str = "") -> int:
    """Device KV blocks: on a CPU device, this rank's share of cpu_kv_cache_gb; on CUDA, gpu_memory_utilization
    of the card minus weights, other processes, `reserved` bytes (the offload ring; reserved_for says what they
    hold, for the error) and the peak activations of a warm-up step (peak_activations runs it and returns its
    peak bytes beyond the KV it used)."""
    if device.type == "cpu":
        budget = host_kv_bytes(config)
    else:
        free, total = torch.cuda.mem_get_info(device)
        other_processes = (total - free) - torch.cuda.memory_reserved(device)
        peak = peak_activations()
        budget = int(total * config.gpu_memory_utilization - peak - other_processes) - reserved
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        beside = f" after {readable_size(reserved)} reserved for {reserved_for}" if reserved and reserved_for else ""
        raise ValueError(f"no memory left for the KV cache: one block needs {bytes_per_block} bytes, budget is "
                         f"{int(budget)}{beside}")
    return blocks


def host_kv_bytes(config: EngineConfig) -> float:
    """One rank's share of cpu_kv_cache_gb: the host memory for KV of all ranks together."""
    return config.cpu_kv_cache_gb * 2**30 / config.tensor_parallel_size
