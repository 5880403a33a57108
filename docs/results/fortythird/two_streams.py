"""Probe: decode graphs of at least SPLIT_MIN rows (env, 0: off) run as two micro-batches on two streams, each
half's whole forward on its own stream, joined before the LM head, so that one half's compute-bound GEMMs may run
beside the other's memory-bound attention (NanoFlow's overlap, left to the hardware scheduler). Then bench/
throughput.py's main with the remaining arguments.

    cd bench && SPLIT_MIN=64 PYTHONPATH=..:. python3 ../docs/results/fortythird/two_streams.py --async-scheduling \
        --hf-seqs 0
"""
from __future__ import annotations

import os

import torch

import throughput
from nanovllm.engine import cuda_graph
from nanovllm.layers.attention import AttentionMetadata

SPLIT_MIN = int(os.environ.get("SPLIT_MIN", "0"))
_plain_forward = cuda_graph.DecodeGraphs._forward


def _rows_metadata(graphs: cuda_graph.DecodeGraphs, lo: int, hi: int) -> AttentionMetadata:
    n = hi - lo
    return AttentionMetadata(
        query_lens=[1] * n, seq_lens=[1] * n, block_tables=[], slot_mapping=graphs.slot_mapping[lo:hi],
        cu_query_lens=graphs.cu_query_lens[: n + 1], seq_lens_tensor=graphs.seq_lens[lo:hi],
        block_tables_tensor=graphs.block_tables[lo:hi], block_size=graphs.block_size,
    )


def split_forward(self: cuda_graph.DecodeGraphs, bs: int, mode: str = "plain") -> torch.Tensor:
    if mode != "plain" or not SPLIT_MIN or bs < SPLIT_MIN:
        return _plain_forward(self, bs, mode)
    half = bs // 2
    self.seq_lens[:bs].copy_(self.positions[:bs] + 1)
    ids = cuda_graph.resolve_placeholders(self.input_ids[:bs], self.last_tokens)
    if not hasattr(self, "side_stream"):
        self.side_stream = torch.cuda.Stream(self.device)
    main = torch.cuda.current_stream(self.device)
    self.side_stream.wait_stream(main)
    with torch.cuda.stream(self.side_stream):
        second = self.model(ids[half:], self.positions[half:bs], self.make_kv(_rows_metadata(self, half, bs), mode))
    first = self.model(ids[:half], self.positions[:half], self.make_kv(_rows_metadata(self, 0, half), mode))
    main.wait_stream(self.side_stream)
    return self.model.compute_logits(torch.cat([first, second]))


cuda_graph.DecodeGraphs._forward = split_forward

if __name__ == "__main__":
    print(f"two-stream decode graphs from {SPLIT_MIN} rows" if SPLIT_MIN else "plain decode graphs", flush=True)
    throughput.main()
