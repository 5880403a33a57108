"""The probes' timer: a function's kernels captured once in a CUDA graph, replayed 20 times."""
import torch


def graph_us(fn, layers: int) -> float:
    """Mean microseconds per layer of fn() (which runs `layers` layers), replayed in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / 20 / layers
