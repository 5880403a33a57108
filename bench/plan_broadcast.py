"""How long one step plan takes to reach the other tensor-parallel ranks: shared memory + an event per
worker (`PlanChannel`, what the engine uses) against `broadcast_object_list` over a gloo group.

Each iteration the driver sends a plan and then joins a one-element all_reduce, which the worker joins
right after it holds the unpickled plan (as a forward pass's first collective would); the all_reduce alone
is measured too and subtracted. CPU only, any number of ranks:

    python bench/plan_broadcast.py --ranks 2 --iters 300 --out docs/results/plan_broadcast_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.distributed.executor import PlanChannel, PlanReceiver, _free_port
from nanovllm.engine.step_plan import StepPlan
from nanovllm.sampling_params import SamplingParams

BLOCK_SIZE = 256
WORKLOADS = {  # name: (sequences, context tokens each, with offload locations)
    "decode 1 x 1K": (1, 1024, False),
    "decode 64 x 8K": (64, 8192, False),
    "decode 256 x 32K": (256, 32768, False),
    "decode 16 x 128K, offload": (16, 131072, True),
}


def decode_plan(num_seqs: int, context: int, offload: bool) -> StepPlan:
    blocks = -(-context // BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(num_seqs)]
    on_host = [[b < blocks // 2 for b in range(blocks)] for _ in range(num_seqs)] if offload else None
    params = [SamplingParams(temperature=0, max_tokens=128) for _ in range(num_seqs)]
    return StepPlan(list(range(num_seqs)), [context - 1] * num_seqs, [t[-1] * BLOCK_SIZE for t in tables],
                    [1] * num_seqs, [context] * num_seqs, tables, on_host, [], list(range(num_seqs)),
                    list(range(num_seqs)), params, seq_ids=list(range(num_seqs)))


def _sync() -> None:
    dist.all_reduce(torch.zeros(1))


def _worker(rank: int, size: int, init: str, channel_name: str, events, iters: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    receiver = PlanReceiver(channel_name, events[rank - 1])
    for _ in WORKLOADS:
        for _ in range(iters):
            _sync()
        for _ in range(iters):
            receiver.receive(lambda: True)
            _sync()
        for _ in range(iters):
            box = [None]
            dist.broadcast_object_list(box, src=0)
            _sync()
    receiver.close()
    dist.destroy_process_group()


def _time(fn, iters: int) -> float:
    """Median microseconds of fn() over iters calls."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    channel = PlanChannel([ctx.Event() for _ in range(args.ranks - 1)])
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, init, channel.name, channel.events, args.iters))
             for r in range(1, args.ranks)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=args.ranks)
    rows = []
    for name, shape in WORKLOADS.items():
        plan = decode_plan(*shape)
        base = _time(_sync, args.iters)
        shm = _time(lambda: (channel.send(("execute", plan)), _sync()), args.iters)
        obj = _time(lambda: (dist.broadcast_object_list([("execute", plan)], src=0), _sync()), args.iters)
        rows.append({"workload": name, "all_reduce_us": round(base, 1), "shared_memory_us": round(shm - base, 1),
                     "broadcast_object_list_us": round(obj - base, 1)})
        print(f"{name:28s} shared memory {shm - base:9.1f} us   broadcast_object_list {obj - base:9.1f} us   "
              f"(1-element all_reduce {base:.1f} us)")
    for p in procs:
        p.join()
    dist.destroy_process_group()
    channel.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": args.ranks, "iters": args.iters, "block_size": BLOCK_SIZE, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
