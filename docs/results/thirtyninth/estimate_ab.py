"""One layer's XAttention estimate at 128K, the package on PYTHONPATH (run once per tree): the last 32K-token chunk of
a 131,072-token prompt over keys in a paged cache of 256-token blocks in shuffled order (Llama-3.1-8B shape, bf16),
`XAttentionSelector.select` as the engine calls it, CUDA-event time per call (median of 10 after 2 untimed).

    PYTHONPATH=TREE python3 docs/results/thirtyninth/estimate_ab.py LABEL
"""
import statistics
import sys

import torch

from nanovllm.layers.block_selector import SelectionInput
from nanovllm.layers.xattention import XAttentionSelector


class Cache:
    def __init__(self, k):
        self.k = k
        self.data = k[None, None]  # [layers, 2, blocks, block_size, Hk, D]: the selector reads data.shape[3]

    def layer(self, layer):
        return self.k, self.k


def main() -> None:
    seq_len, n_q, block, hk, hq, dim = 131072, 32768, 256, 8, 32, 128
    if "--small" in sys.argv:  # a check of the script on the CPU
        seq_len, n_q, device = 4096, 1024, "cpu"
        torch.cuda.Event = lambda enable_timing: type("E", (), {"record": lambda s: None, "elapsed_time": lambda s, o: 0.0})()
        torch.cuda.synchronize = lambda: None
    else:
        device = "cuda"
    blocks = seq_len // block
    k = torch.randn(blocks + 4, block, hk, dim, dtype=torch.bfloat16, device=device)
    table = torch.randperm(blocks + 4)[:blocks].tolist()
    q = torch.randn(n_q, hq, dim, dtype=torch.bfloat16, device=device)
    selector = XAttentionSelector(Cache(k), None, threshold=0.2, stride=16, block_size=128, min_context=0,
                                  cover="group")
    batch = SelectionInput([n_q], [seq_len], block, [table])
    times = []
    for i in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        selector.select(0, q, hk, batch)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            selector.select(0, q, hk, batch)
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:60]] = kernels.get(e.name[:60], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {sys.argv[1]} {ms:7.3f} ms  {name}")
    print(f"{sys.argv[1]}: estimate of one layer (32K queries over 128K keys) median {statistics.median(times):.2f} ms, "
          f"min {min(times):.2f}")


if __name__ == "__main__":
    main()
