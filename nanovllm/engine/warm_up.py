"""Start-up steps that compile the Triton kernel variants requests would otherwise wait for.

The decode graphs compile what pure decode steps run when they are captured, and the warm-up forward
that sizes the KV pool compiles a whole-prompt prefill. What is left is what a mixed step (a prefill
chunk beside decoding rows, outside the graphs) and temperature sampling run: the decode kernel over
chosen rows with one split and with several, its merge, and the one-pass sampler. Measured on the H200
(kernels/compile_watch.py): the first batch of 32 requests waited 1.56 s against 0.21 s warm for those.
"""
from __future__ import annotations

import torch

from nanovllm.layers.kv_access import DeviceKV
from nanovllm.layers.sampler import sample_on_device
from nanovllm.sampling_params import SamplingParams

PREFILL_ROWS = 32
LONG_ROW = 4096  # keys of the long decode row: 64 KV tiles, several decode splits


@torch.inference_mode()
def compile_step_variants(worker) -> None:
    """One mixed step through the model (a prefill chunk, a short and a long decode row) and one sampled
    token per row. Writes KV into the first blocks of the pool: at start-up no request holds them."""
    block_size, config = worker.block_size, worker.config
    long_row = min(config.max_model_len - 1, worker.num_blocks * block_size, LONG_ROW)
    query_lens = [min(PREFILL_ROWS, long_row), 1, 1]
    seq_lens = [query_lens[0], min(16, long_row), long_row]
    table = list(range(-(-max(seq_lens) // block_size)))
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    slots = [table[p // block_size] * block_size + p % block_size for p in positions]
    meta = worker.backend.build_metadata(query_lens, seq_lens, [table] * 3, slots, block_size, worker.device)
    ids = torch.arange(len(positions), device=worker.device) % worker.model.config.vocab_size
    kv = DeviceKV(worker.kv_cache, worker.backend, meta)
    hidden = worker.model(ids, torch.tensor(positions, device=worker.device), kv)
    last_rows = torch.tensor([query_lens[0] - 1, query_lens[0], query_lens[0] + 1], device=worker.device)
    logits = worker.model.compute_logits(hidden[last_rows])
    generator = torch.Generator(worker.device).manual_seed(0)  # leaves the engine's own stream untouched
    sample_on_device(logits, [SamplingParams(temperature=1.0)] * 3, [None] * 3, generator)
