"""Copies inside CUDA graphs whose addresses change between replays (nanovllm.engine.graph_copies)."""
from __future__ import annotations

import pytest
import torch

from nanovllm.engine import graph_copies

pytestmark = pytest.mark.cuda


def test_copy_nodes_take_new_addresses_before_each_replay():
    assert graph_copies.available()
    g = torch.Generator().manual_seed(1)
    host = torch.randn(8, 4096, generator=g).pin_memory()
    dst = torch.full((4, 4096), float("nan"), device="cuda")
    row = host[0].numel() * host.element_size()
    side = torch.cuda.Stream()
    keys = {}
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(2):  # placeholders: 16 bytes each, (dst, src) distinct
                keys[(dst.data_ptr() + 16 * i, host.data_ptr() + 16 * i)] = i
                graph_copies.capture_copy(dst.data_ptr() + 16 * i, host.data_ptr() + 16 * i, 16)
        torch.cuda.current_stream().wait_stream(side)
        doubled = dst * 2  # a kernel after the copies, in the same graph
    graph.instantiate()
    copies = graph_copies.GraphCopies(graph, keys)
    assert sorted(copies.nodes) == [0, 1]

    for a, b in [(5, 2), (7, 0), (1, None), (3, 6), (3, 6)]:
        plan = {0: (dst[0].data_ptr(), host[a].data_ptr(), row),
                1: None if b is None else (dst[1].data_ptr(), host[b].data_ptr(), 2 * row)}
        copies.set(plan, version=(a, b))
        assert copies.set(plan, version=(a, b)) == 0  # the same step again: nothing to update
        dst.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst[0].cpu(), host[a])
        if b is None:  # that copy was turned off; the kernel after it still ran
            assert dst[1:].isnan().all()
        else:
            assert torch.equal(dst[1:3].cpu(), host[b : b + 2]) and dst[3].isnan().all()
        assert torch.equal(doubled[0].cpu(), 2 * host[a])


def test_missing_placeholders_are_an_error():
    host = torch.zeros(1024).pin_memory()
    dst = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        graph_copies.capture_copy(dst.data_ptr(), host.data_ptr(), 16)
    graph.instantiate()
    with pytest.raises(graph_copies.CudaRuntimeError, match="1 of 2 captured copies not found"):
        graph_copies.GraphCopies(graph, {(dst.data_ptr(), host.data_ptr()): 0, (1, 2): 1})
