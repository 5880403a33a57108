"""Host-side pieces of the decode CUDA graphs that need no GPU."""
from __future__ import annotations

import gc
import random

import numpy as np
import pytest

import torch

from nanovllm.engine.cuda_graph import DecodeGraphs, batch_buckets
from nanovllm.host_arrays import fill_tables, list_to_device, tables_to_device


def test_fill_tables_equals_row_by_row():
    rng = random.Random(0)
    tables = [[rng.randint(0, 999) for _ in range(rng.randint(1, 9))] for _ in range(50)] + [[5] * 12]
    got = np.full((len(tables), 12), -7, dtype=np.int64)
    fill_tables(got, tables)
    want = np.full_like(got, -7)
    for row, table in zip(want, tables):
        row[: len(table)] = table
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_lists_to_device_equal_torch_tensor(dtype):
    """A step's lists through numpy: the tensors torch.tensor makes of them (values, dtype, shape), empty ones too;
    tables of different lengths padded."""
    rng = random.Random(1)
    values = [rng.randint(0, 2**31 - 1 if dtype != torch.float32 else 999) for _ in range(1000)]
    for given in (values, [], values[:1]):
        got = list_to_device(given, dtype, torch.device("cpu"))
        assert got.dtype == dtype and torch.equal(got, torch.tensor(given, dtype=dtype))
    tables = [[rng.randint(0, 9999) for _ in range(n)] for n in (3, 0, 7, 1)]
    want = torch.tensor([t + [-1] * (7 - len(t)) for t in tables], dtype=torch.int64)
    assert torch.equal(tables_to_device(tables, -1, torch.device("cpu")), want)
    assert tables_to_device([], -1, torch.device("cpu")).shape == (0, 0)


def test_batch_buckets_cover_every_batch_size():
    buckets = batch_buckets(100)
    assert buckets[0] == 1 and buckets[-1] == 100 and buckets == sorted(set(buckets))
    assert all(any(b >= n for b in buckets) for n in range(1, 101))


@pytest.mark.parametrize("fails", [False, True])
def test_graphs_are_captured_with_the_cyclic_gc_off_and_it_is_back_after(fails):
    """A collection in mid-capture could free an earlier engine's graphs inside this capture (which
    invalidates it): the captures run with the collector off, and it is on again after, failure or not."""
    seen = []

    class Capturing(DecodeGraphs):
        def __init__(self):  # no GPU: only the capture's frame
            pass

        def _capture_modes(self):
            seen.append(gc.isenabled())
            if fails:
                raise RuntimeError("capture failed")

    assert gc.isenabled()
    if fails:
        with pytest.raises(RuntimeError, match="capture failed"):
            Capturing()._capture_all()
    else:
        Capturing()._capture_all()
    assert seen == [False] and gc.isenabled()
