"""Start-up steps that compile the Triton kernel variants requests would otherwise wait for.

The decode graphs compile what pure decode steps run when they are captured, and the warm-up forward
that sizes the KV pool compiles a whole-prompt prefill. What is left is what a mixed step (a prefill
chunk beside decoding rows, outside the graphs) and temperature sampling run: the decode kernel over
chosen rows with one split (a mixed step whose decode rows are all short) and with several, the merge
of the splits, and the one-pass sampler; under a sparse policy also the
per-KV-head variants of prefill and decode that its selections take, and the policy's own kernels (its
minimum context set aside for the start-up rows). Measured on the H200 (kernels/compile_watch.py) before these
steps: the first batch of 32 requests waited 0.75 s for two of those to compile, and XAttention's first
sparse prefill 1.6 s for one. Then prefill forwards at a ladder of token counts: with CUDA's lazy module
loading (torch's default) the first forward of a new token count loads the GEMM kernels picked for it
(a first 1K prompt waited 7-21 ms for them, nothing compiled; docs/BENCHMARKS.md). Last, greedy and
temperature sampling of a single row and of several: the first greedy token of a fresh engine waited
8 ms for the argmax kernel to load (torch.profiler, H200). An offload engine also runs its split attention
(float32 partial results, a history pass merged in) over the mixed steps' rows and over decode rows alone (a
mixed step's decode rows attend as a part of their own), whose kernel variants the device-only steps do not
meet, and the pure decode steps outside the graphs that its steps over host blocks are (and, as its strategies
store K/V themselves, RoPE without the KV store); its start-up rows may be longer than its device pool, whose
blocks they then read again. The selector's pass counts what it reads, as a request's steps do (Quest's rerank
has a variant counting host keys: 541 ms on a Qwen RULER run).
"""
from __future__ import annotations

import itertools

import torch

from nanovllm.layers.block_selector import BlockSelector, Selection, SelectionInput, SparseStats
from nanovllm.layers import cudnn_prefill
from nanovllm.layers.kv_access import DeviceKV
from nanovllm.layers.sampler import sample_on_device
from nanovllm.sampling_params import SamplingParams

PREFILL_ROWS = 32
LONG_ROW = 4096  # keys of the long decode row: 64 KV tiles, several decode splits
SHORT_ROW = 16  # keys of a short decode row: one tile, so one split when it is the longest
LADDER_START = 64  # the smallest token count of the start-up prefill ladder (decode graphs cover fewer)


def mixed_step_layouts(max_model_len: int) -> list[tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) of the start-up mixed steps: a prefill chunk beside decode rows whose longest
    is long (the decode kernel over chosen rows in several splits, and their merge), beside a short one
    only (one split: the kernel writes its result directly, another variant)."""
    long_row, short = _decode_row_lengths(max_model_len)
    prefill = min(PREFILL_ROWS, long_row)
    return [([prefill, 1, 1], [prefill, short, long_row]), ([prefill, 1], [prefill, short])]


def selector_step_layouts(max_model_len: int, selector_row: int) -> list[tuple[list[int], list[int]]]:
    """The start-up mixed steps through a sparse policy's own selector: mixed_step_layouts and, where the selector
    narrows only rows longer than theirs (`BlockSelector.warm_up_row`), a prefill chunk beside such a row (Quest
    at a budget of 8,192 compiled its scores and rerank kernels on the request path of a Qwen RULER run)."""
    layouts = mixed_step_layouts(max_model_len)
    row = min(max_model_len - 1, selector_row)
    if row <= max(max(seq_lens[1:]) for _, seq_lens in layouts):
        return layouts
    prefill = layouts[0][0][0]
    return layouts + [([prefill, 1], [prefill, row])]


def decode_step_layouts(max_model_len: int) -> list[tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) of start-up pure decode steps, for the steps no decode graph runs (an engine
    without graphs, an offload engine's steps over host blocks): one short row (one split, written directly),
    a short beside a long one (several splits, merged) and a long one alone (split at one pipeline stage:
    `decode_num_stages`)."""
    long_row, short = _decode_row_lengths(max_model_len)
    return [([1], [short]), ([1, 1], [short, long_row]), ([1], [long_row])]


def _decode_row_lengths(max_model_len: int) -> tuple[int, int]:
    """Keys of the long and the short decode row of the start-up steps (a row longer than the pool reads its
    blocks again: `warm_up_table`)."""
    long_row = min(max_model_len - 1, LONG_ROW)
    return long_row, min(SHORT_ROW, long_row)


def warm_up_table(num_tokens: int, block_size: int, num_blocks: int) -> list[int]:
    """The block table of a start-up row: the pool's first blocks, from the first again past the pool's end
    (an offload engine's device pool may hold fewer keys than its rows; the values read do not matter)."""
    return [b % num_blocks for b in range(-(-num_tokens // block_size))]


def prefill_ladder(max_batched_tokens: int, max_model_len: int, pool_tokens: int) -> list[int]:
    """Token counts of the start-up prefill forwards: powers of two from LADDER_START below the largest
    step the scheduler makes (the forward that sized the KV pool ran that one) and what the pool holds."""
    top = min(max_batched_tokens, max_model_len, pool_tokens)
    return [1 << k for k in range(LADDER_START.bit_length() - 1, top.bit_length()) if LADDER_START <= 1 << k < top]


@torch.inference_mode()
def compile_step_variants(worker) -> None:
    """The start-up mixed steps (and pure decode steps where no decode graph runs them), the prefill ladder,
    through the model, and sampled tokens. They write KV into the first blocks of the pool: at start-up no
    request holds them."""
    layouts = mixed_step_layouts(worker.config.max_model_len)
    for query_lens, seq_lens in layouts:
        logits = _mixed_step(worker, query_lens, seq_lens)
    if not worker.selector.dense:  # a sparse policy's steps attend over per-KV-head tables: other variants
        for query_lens, seq_lens in layouts:
            _mixed_step(worker, query_lens, seq_lens, EveryBlockPerHead())
        # and its own kernels (scores, top, rerank, estimate), counting what they read (the rerank's host-read
        # variant), over rows it narrows
        row = worker.selector.warm_up_row(worker.block_size)
        selector_layouts = selector_step_layouts(worker.config.max_model_len, row)
        with worker.selector.selecting_at_any_length():
            for query_lens, seq_lens in selector_layouts:
                _mixed_step(worker, query_lens, seq_lens, worker.selector, SparseStats(len(query_lens)))
        worker.selector.warm_up(worker.kv_cache.layer(0)[0].shape[2], worker.device)
    config = worker.config
    # enforce_eager: nothing captured the pure decode steps' kernels; offload: steps over host blocks run eagerly
    if worker.graphs is None or worker.host_pool is not None:
        selectors = [None] if worker.selector.dense else [None, EveryBlockPerHead()]
        for query_lens, seq_lens in decode_step_layouts(config.max_model_len):
            for selector in selectors:
                _mixed_step(worker, query_lens, seq_lens, selector)
    if worker.host_pool is not None or not worker.selector.dense:  # attend() stores K/V: RoPE without the store
        _mixed_step(worker, *decode_step_layouts(config.max_model_len)[0], kv_access=AttendStores)
    for tokens in prefill_ladder(config.max_num_batched_tokens, config.max_model_len, worker.num_blocks * worker.block_size):
        _mixed_step(worker, [tokens], [tokens])
    _cudnn_route(worker)
    if worker.host_pool is not None:  # offload: steps that split their attention merge float32 partial results
        tables = [False] if worker.selector.dense else [False, True]  # dense, and per KV head
        steps = layouts + decode_step_layouts(config.max_model_len)  # a mixed step's decode rows: a part of its own
        for (query_lens, seq_lens), per_head in itertools.product(steps, tables):
            _split_attention(worker, query_lens, seq_lens, per_head)
    _sample_rows(logits)


def _cudnn_route(worker) -> None:
    """The cuDNN prefill route (layers/cudnn_prefill.py): a plan for each padded prefix-free chunk size, and
    a chunk over a cached prefix (its merge kernel)."""
    k_cache = worker.kv_cache.layer(0)[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not (getattr(worker.backend, "prefill_through_cudnn", False) and cudnn_prefill.supports(k_cache.dtype, head_dim, worker.device)):
        return
    config, chunk = worker.config, cudnn_prefill.MIN_QUERY_TOKENS
    num_heads = num_kv_heads * (worker.model.config.num_heads // worker.model.config.num_kv_heads)
    longest = min(config.max_num_batched_tokens, config.max_model_len)
    cudnn_prefill.warm_up(num_heads, num_kv_heads, head_dim, k_cache.dtype, worker.device, longest)
    if chunk <= config.max_num_batched_tokens and 2 * chunk <= min(config.max_model_len, worker.num_blocks * worker.block_size):
        _mixed_step(worker, [chunk], [2 * chunk])


def _split_attention(worker, query_lens: list[int], seq_lens: list[int], per_head: bool) -> None:
    """An offload step's split attention over the pool's first blocks: the rows over their own blocks (causal)
    and a history pass (non-causal, merged in), both into float32 (out, LSE), with the dense tables or per
    KV head. Its kernel variants (float32 outputs, the history's) are not the device-only steps' (a first
    Quest offload request compiled two, 1.7 s, on the H200)."""
    backend, block_size = worker.backend, worker.block_size
    k_cache, v_cache = worker.kv_cache.layer(0)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    mc = worker.model.config
    num_heads = num_kv_heads * (mc.num_heads // mc.num_kv_heads)  # this rank's heads under tensor parallelism
    table = warm_up_table(max(seq_lens), block_size, worker.num_blocks)
    if per_head:
        tables = torch.tensor([table] * len(seq_lens), device=worker.device)[:, None, :].expand(-1, num_kv_heads, -1)
        lengths = torch.tensor(seq_lens, device=worker.device)[:, None].expand(-1, num_kv_heads)
        meta = backend.build_head_metadata(query_lens, lengths, tables, block_size, worker.device,
                                           max_seq_lens=seq_lens)
    else:
        meta = backend.build_metadata(query_lens, seq_lens, [table] * len(seq_lens), [], block_size, worker.device)
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=k_cache.dtype, device=worker.device)
    out = (torch.empty(q.shape, dtype=torch.float32, device=q.device),
           torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))
    backend.forward_with_lse(q, k_cache, v_cache, meta, head_dim ** -0.5, out=out)
    backend.history_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, out)


def _sample_rows(logits: torch.Tensor) -> None:
    """Greedy and temperature sampling of one row (a prefill's token) and of every row (a batch)."""
    generator = torch.Generator(logits.device).manual_seed(0)  # leaves the engine's own stream untouched
    for rows in (logits[:1], logits):
        for temperature in (0.0, 1.0):
            sample_on_device(rows, [SamplingParams(temperature=temperature)] * rows.shape[0], [None] * rows.shape[0],
                             generator)


class EveryBlockPerHead(BlockSelector):
    """Every block, as a per-KV-head selection: the steps take the per-head kernel variants (prefill and
    decode rows) that a sparse policy's selections use, whatever the rows' lengths."""

    def select(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput) -> Selection:
        return [torch.ones(num_kv_heads, batch.num_blocks(i), dtype=torch.bool, device=q.device)
                for i in range(len(batch.seq_lens))]


class AttendStores(DeviceKV):
    """Device KV whose attend() stores the new K/V, as the offload and narrowed strategies do (they have no write
    target): the model's RoPE then takes its variant without the KV store."""

    def write_target(self, layer: int) -> None:
        return None


def _mixed_step(worker, query_lens: list[int], seq_lens: list[int], selector: BlockSelector | None = None,
                stats: SparseStats | None = None, kv_access: type[DeviceKV] = DeviceKV) -> torch.Tensor:
    """One forward of these rows over the pool's first blocks; the logits of each row's last token."""
    block_size = worker.block_size
    table = warm_up_table(max(seq_lens), block_size, worker.num_blocks)
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    slots = [table[p // block_size] * block_size + p % block_size for p in positions]
    tables = [table] * len(query_lens)
    meta = worker.backend.build_metadata(query_lens, seq_lens, tables, slots, block_size, worker.device)
    ids = torch.arange(len(positions), device=worker.device) % worker.model.config.vocab_size
    kv = kv_access(worker.kv_cache, worker.backend, meta, selector, stats)
    hidden = worker.model(ids, torch.tensor(positions, device=worker.device), kv)
    last_rows = torch.tensor(list(itertools.accumulate(query_lens)), device=worker.device) - 1
    return worker.model.compute_logits(hidden[last_rows])
