"""Host-side work of one sparse prefill layer call, on the CPU: the aten ops a DeviceKV.attend dispatches
for "full" and "xattention", the attention kernel itself left out (on the GPU it is one Triton launch, on
the CPU the torch reference would dominate the counts). The ops are counted on the CPU and again on the
"meta" device (shapes only), where, as on a GPU, a host list copied to the device is dispatched too.

On the GPU every eager op costs ~10-20 us of host time, and a layer's ops must be queued faster than the
GPU runs them: the op count per layer call is what this measures. Shape: a Qwen2.5-0.5B layer (14 query
heads, 2 KV heads, head_dim 64), KV block 256, one prefill chunk of --chunk queries ending at --context,
beside --decode-rows decode rows; XAttention as the engine's defaults (threshold 0.9, stride 16, block 128,
cover "head"). Also the profiler's self CPU time of the layer call without the kernel, and without the
heavy math (matmuls, softmax, sort), which on the GPU costs the host a launch only.

    PYTHONPATH=. python3 bench/sparse_host_ops.py [--context 32768] [--chunk 8192] [--decode-rows 2]
"""
from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.layers.attention import TorchPagedAttention
from nanovllm.layers.block_selector import BlockSelector, DenseSelector, SparseStats
from nanovllm.layers.kv_access import DeviceKV
from nanovllm.layers.sparse_policies import XAttentionSelector

HEADS, KV_HEADS, DIM, BLOCK = 14, 2, 64, 256
HEAVY = {"aten::bmm", "aten::mm", "aten::addmm", "aten::_softmax", "aten::softmax", "aten::sort", "aten::cumsum"}


class NoKernel(TorchPagedAttention):
    """The torch backend with the attention itself skipped: only the metadata it is handed is built."""

    def forward(self, q, k_cache, v_cache, meta, scale, host_kv=None):
        return q


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def layer_call(make_selector: Callable[[PagedKVCache], BlockSelector], context: int, chunk: int,
               decode_rows: int, device: torch.device) -> Callable[[], torch.Tensor]:
    """One layer call of a mixed step: a prefill chunk of `chunk` queries at the end of `context` tokens,
    and `decode_rows` decode rows of `context` tokens each."""
    per_seq = -(-context // BLOCK)
    num_seqs = 1 + decode_rows
    cache = PagedKVCache(1, per_seq * num_seqs, BLOCK, KV_HEADS, DIM, torch.float32, device)
    cache.data.normal_()
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    query_lens, seq_lens = [chunk] + [1] * decode_rows, [context] * num_seqs
    slots = [tables[0][p // BLOCK] * BLOCK + p % BLOCK for p in range(context - chunk, context)]
    slots += [t[(context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK for t in tables[1:]]
    backend = NoKernel()
    meta = backend.build_metadata(query_lens, seq_lens, tables, slots, BLOCK, device)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(slots), HEADS, DIM, generator=g).to(device)
    k, v = (torch.randn(len(slots), KV_HEADS, DIM, generator=g).to(device) for _ in range(2))
    kv = DeviceKV(cache, backend, meta, make_selector(cache), SparseStats(num_seqs))
    return lambda: kv.attend(0, q, k, v, DIM**-0.5)


SELECTORS: dict[str, Callable[[PagedKVCache], BlockSelector]] = {
    "full": lambda cache: DenseSelector(),
    "xattention": lambda cache: XAttentionSelector(cache, None, threshold=0.9, stride=16, block_size=128,
                                                   min_context=0, cover="head"),
}


def count_ops(call) -> Counter[str]:
    call()  # warm-up: first-call caches
    with OpCounter() as counter:
        call()
    return counter.ops


def host_ms(call) -> tuple[float, float]:
    """Self CPU ms of one call (profiler), all ops and without the heavy math."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3
    light = sum(e.self_cpu_time_total for e in events if e.key not in HEAVY) / 1e3
    return total, light


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--decode-rows", type=int, default=2)
    parser.add_argument("--top", type=int, default=15, help="the most frequent ops of the xattention call")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    counts, device_counts, times = {}, {}, {}
    for name, make_selector in SELECTORS.items():
        call = layer_call(make_selector, args.context, args.chunk, args.decode_rows, torch.device("cpu"))
        counts[name] = count_ops(call)
        times[name] = host_ms(call)
        shapes_only = layer_call(make_selector, args.context, args.chunk, args.decode_rows, torch.device("meta"))
        device_counts[name] = count_ops(shapes_only)
    print(f"one layer call: prefill chunk {args.chunk} at context {args.context}, {args.decode_rows} decode rows, "
          f"{HEADS}/{KV_HEADS} heads, head_dim {DIM}, KV block {BLOCK} (attention kernel not run)")
    for name in counts:
        total, light = times[name]
        print(f"  {name:10s} {sum(counts[name].values()):5d} aten ops ({sum(device_counts[name].values()):5d} on a "
              f"device); self CPU {total:8.1f} ms, "
              f"without {'/'.join(sorted(h.removeprefix('aten::') for h in HEAVY))} {light:7.1f} ms")
    ratio = sum(counts["xattention"].values()) / max(1, sum(counts["full"].values()))
    device_ratio = sum(device_counts["xattention"].values()) / max(1, sum(device_counts["full"].values()))
    print(f"  xattention/full ops: {ratio:.1f}x ({device_ratio:.1f}x on a device)")
    print("  xattention's most frequent ops on a device: " + ", ".join(
        f"{op.removeprefix('aten::')} {n}" for op, n in device_counts["xattention"].most_common(args.top)))


if __name__ == "__main__":
    main()
