"""Host-side work of one sparse prefill layer call, on the CPU: the aten ops a DeviceKV.attend (with
--offload, a SplitKV.attend over KV mostly in the host pool) dispatches for "full" and "xattention", and the
reads of device values to the host (syncs on CUDA), the attention kernel itself left out (on the GPU it is one Triton launch, on
the CPU the torch reference would dominate the counts). The ops are counted on the CPU and again on the
"meta" device (shapes only), where, as on a GPU, a host list copied to the device is dispatched too.

On the GPU every eager op costs ~10-20 us of host time, and a layer's ops must be queued faster than the
GPU runs them: the op count per layer call is what this measures. A read of a device value (`.cpu()`,
`.tolist()`, `.item()`, `bool()`...) also waits for the GPU to drain: on the meta device such a read is
counted and answered with ones (every block attended) instead of failing. Shape: a Qwen2.5-0.5B layer (14 query
heads, 2 KV heads, head_dim 64), KV block 256, one prefill chunk of --chunk queries ending at --context,
beside --decode-rows decode rows (--offload: the chunk's blocks on the device, every older block in the host
pool, a ring slot holding them all, as a bfloat16 slot does on the H200); XAttention as the engine's defaults (threshold 0.9, stride 16, block 128,
cover "head"). Also the profiler's self CPU time of the layer call without the kernel, and without the
heavy math (matmuls, softmax, sort), which on the GPU costs the host a launch only.

    PYTHONPATH=. python3 bench/sparse_host_ops.py [--context 32768] [--chunk 8192] [--decode-rows 2] [--offload]
"""
from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.engine.offload.host_pool import HostKVPool
from nanovllm.engine.offload.split import SplitKV
from nanovllm.layers.attention import TorchPagedAttention
from nanovllm.layers.block_selector import BlockSelector, DenseSelector, SparseStats
from nanovllm.layers.kv_access import DeviceKV
from nanovllm.layers.xattention import XAttentionSelector

HEADS, KV_HEADS, DIM, BLOCK = 14, 2, 64, 256
HEAVY = {"aten::bmm", "aten::mm", "aten::addmm", "aten::_softmax", "aten::softmax", "aten::sort", "aten::cumsum"}


class NoKernel(TorchPagedAttention):
    """The torch backend with the attention itself skipped: only the metadata it is handed is built."""

    def forward(self, q, k_cache, v_cache, meta, scale, host_kv=None):
        return q

    def forward_with_lse(self, q, k_cache, v_cache, meta, scale, out=None):
        return out

    def history_attention(self, q, k_cache, v_cache, meta, scale, out):
        pass


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


VALUE_READS = frozenset({"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"})


class HostReads(TorchFunctionMode):
    """Counts reads of meta tensors' values to the host, each a sync were the meta device a GPU, and
    answers them with ones of the tensor's shape (a meta tensor has no values)."""

    def __init__(self):
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and source.is_meta and (name in VALUE_READS or name == "cpu" or
                                                      name == "to" and _to_host(args[1:], kwargs)):
            self.reads[name] += 1
            with _disable_current_modes():  # not an op of the call: OpCounter leaves it out
                ones = torch.ones(source.shape, dtype=source.dtype)
                return ones if name in ("cpu", "to") else getattr(ones, name)()
        if name == "copy_" and source is not None and not source.is_meta and getattr(args[1], "is_meta", False):
            self.reads[name] += 1
            with _disable_current_modes():
                return source.fill_(1)
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


LayerCall = Callable[[], torch.Tensor]
MakeSelector = Callable[[PagedKVCache, HostKVPool | None], BlockSelector]


def mixed_step(context: int, chunk: int, decode_rows: int) -> tuple[list[int], list[int], int]:
    """A prefill chunk of `chunk` queries at the end of `context` tokens and `decode_rows` decode rows of
    `context` tokens each: query lens, seq lens, blocks per sequence."""
    return [chunk] + [1] * decode_rows, [context] * (1 + decode_rows), -(-context // BLOCK)


def new_kv(num_tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, HEADS, DIM, generator=g).to(device)
    k, v = (torch.randn(num_tokens, KV_HEADS, DIM, generator=g).to(device) for _ in range(2))
    return q, k, v


def new_token_slots(tables: list[list[int]], query_lens: list[int], seq_lens: list[int]) -> list[int]:
    return [t[p // BLOCK] * BLOCK + p % BLOCK for t, q, n in zip(tables, query_lens, seq_lens) for p in range(n - q, n)]


def layer_call(make_selector: MakeSelector, context: int, chunk: int, decode_rows: int,
               device: torch.device) -> LayerCall:
    """One DeviceKV layer call of the mixed step (mixed_step), every block on the device."""
    query_lens, seq_lens, per_seq = mixed_step(context, chunk, decode_rows)
    num_seqs = len(seq_lens)
    cache = PagedKVCache(1, per_seq * num_seqs, BLOCK, KV_HEADS, DIM, torch.float32, device)
    cache.data.normal_()
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    slots = new_token_slots(tables, query_lens, seq_lens)
    backend = NoKernel()
    meta = backend.build_metadata(query_lens, seq_lens, tables, slots, BLOCK, device)
    q, k, v = new_kv(len(slots), device)
    kv = DeviceKV(cache, backend, meta, make_selector(cache, None), SparseStats(num_seqs))
    return lambda: kv.attend(0, q, k, v, DIM**-0.5)


def offload_layer_call(make_selector: MakeSelector, context: int, chunk: int, decode_rows: int,
                       device: torch.device) -> LayerCall:
    """One SplitKV layer call of the mixed step (mixed_step): the blocks holding new tokens on the device,
    the older ones in the host pool."""
    query_lens, seq_lens, per_seq = mixed_step(context, chunk, decode_rows)
    on_host = [[b < (n - q) // BLOCK for b in range(per_seq)] for q, n in zip(query_lens, seq_lens)]
    num_host, num_device = sum(map(sum, on_host)), sum(f.count(False) for f in on_host)
    cache = PagedKVCache(1, num_device, BLOCK, KV_HEADS, DIM, torch.float32, device)
    cache.data.normal_()
    pool = HostKVPool(cache, num_host, ring_blocks=num_host)
    pool.host.normal_()
    host_ids, device_ids = iter(range(num_host)), iter(range(num_device))
    tables = [[next(host_ids) if h else next(device_ids) for h in flags] for flags in on_host]
    slots = new_token_slots(tables, query_lens, seq_lens)
    q, k, v = new_kv(len(slots), device)
    kv = SplitKV(pool, cache, NoKernel(), [], tables, on_host, query_lens, seq_lens, slots, make_selector(cache, pool),
                 SparseStats(len(seq_lens)))
    kv.begin()
    return lambda: kv.attend(0, q, k, v, DIM**-0.5)


SELECTORS: dict[str, MakeSelector] = {
    "full": lambda cache, pool: DenseSelector(),
    "xattention": lambda cache, pool: XAttentionSelector(cache, pool, threshold=0.9, stride=16, block_size=128,
                                                         min_context=0, cover="head"),
}


def count_ops(call: LayerCall) -> Counter[str]:
    call()  # warm-up: first-call caches (a step's plans, built in its first layer)
    with OpCounter() as counter:
        call()
    return counter.ops


def count_on_device(call: LayerCall) -> tuple[Counter[str], Counter[str]]:
    """Ops and reads of device values (syncs) per layer call, of a call on the meta device."""
    with HostReads():
        call()  # warm-up, under the mode too: its reads have no values either
    with HostReads() as reads, OpCounter() as counter:
        call()
    return counter.ops, reads.reads


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
    parser.add_argument("--offload", action="store_true", help="SplitKV over a host pool instead of DeviceKV")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    build = offload_layer_call if args.offload else layer_call
    counts, device_counts, reads, times = {}, {}, {}, {}
    for name, make_selector in SELECTORS.items():
        call = build(make_selector, args.context, args.chunk, args.decode_rows, torch.device("cpu"))
        counts[name] = count_ops(call)
        times[name] = host_ms(call)
        shapes_only = build(make_selector, args.context, args.chunk, args.decode_rows, torch.device("meta"))
        device_counts[name], reads[name] = count_on_device(shapes_only)
    print(f"one {'SplitKV (offload)' if args.offload else 'DeviceKV'} layer call: prefill chunk {args.chunk} at "
          f"context {args.context}, {args.decode_rows} decode rows, {HEADS}/{KV_HEADS} heads, head_dim {DIM}, "
          f"KV block {BLOCK} (attention kernel not run)")
    for name in counts:
        total, light = times[name]
        read_list = ", ".join(f"{op} {n}" for op, n in reads[name].most_common())
        print(f"  {name:10s} {sum(counts[name].values()):5d} aten ops ({sum(device_counts[name].values()):5d} on a "
              f"device), {sum(reads[name].values())} device reads{f' ({read_list})' if read_list else ''}; "
              f"self CPU {total:8.1f} ms, "
              f"without {'/'.join(sorted(h.removeprefix('aten::') for h in HEAVY))} {light:7.1f} ms")
    ratio = sum(counts["xattention"].values()) / max(1, sum(counts["full"].values()))
    device_ratio = sum(device_counts["xattention"].values()) / max(1, sum(device_counts["full"].values()))
    print(f"  xattention/full ops: {ratio:.1f}x ({device_ratio:.1f}x on a device)")
    print("  xattention's most frequent ops on a device: " + ", ".join(
        f"{op.removeprefix('aten::')} {n}" for op, n in device_counts["xattention"].most_common(args.top)))


if __name__ == "__main__":
    main()
