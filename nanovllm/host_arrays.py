"""A step's Python lists of numbers as tensors on its device, built on the host through numpy: torch.tensor unboxes
a list of 8,448 ints in ~440 us on the 2-core VM, numpy's fromiter in ~110 (an eager mixed step makes several)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def list_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat list of numbers as a 1-D tensor of dtype on device (copied without waiting where the device allows)."""
    array = np.fromiter(values, dtype=_NUMPY[dtype], count=len(values))
    return torch.from_numpy(array).to(device, non_blocking=True)


def tables_to_device(tables: Sequence[Sequence[int]], fill: int, device: torch.device) -> torch.Tensor:
    """Rows of different lengths as an int64 [rows, longest] tensor on device, padded with fill."""
    array = np.full((len(tables), max(map(len, tables), default=0)), fill, dtype=np.int64)
    fill_tables(array, tables)
    return torch.from_numpy(array).to(device, non_blocking=True)


def fill_tables(dst: np.ndarray, tables: Sequence[Sequence[int]]) -> None:
    """dst[i, :len(tables[i])] = tables[i] for every i, in a few vectorised numpy operations."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    dst[np.repeat(np.arange(len(tables)), lens), np.arange(flat.size) - starts] = flat
