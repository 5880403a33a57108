"""Block-sparse attention on a Llama-3.1-8B shape (random bf16 weights), peers in the same process:

- prefill attention, one layer: XAttention (estimate, selection and the block-sparse kernel, the KV
  write included) against our dense causal kernel and torch SDPA (cuDNN / flash, the faster), at each
  context. Random weights give near-uniform attention, where no block can be skipped; the inputs are
  therefore shaped: per KV head a random 8% of the 128-token key blocks carry the head's query direction, so
  the estimate finds a sparse mass (the density it selects is printed beside the speed);
- decode with KV offloaded (the device KV blocks of bench/offload.py's 24 GB-card budget; Quest's key
  bounds and its dense layers' device mirror come on top and are printed): Quest at token budgets 2048 and 4096
  (the bound alone, quest_rerank=1; --rerank-peer 2 adds the default until the twenty-ninth session, --mass-peer
  the same ranked by mass, --key-copy-peer [8 4] pages scored through an int8 / int4 copy of every key, int8 the
  default now; --copied-host-keys-peer the int8 copy's peer with host pages' keys read from the copy, only values
  over PCIe, quest_host_keys="copy")
  against dense offload, on the same prefilled sequences (the selector is swapped between timings); host bytes
  per step, the PCIe floor of those bytes and the GB/s achieved;
- GPU-only decode, Quest against dense, same sequences;
- with --e2e-contexts: end-to-end prefill of one random prompt per length through --config's random weights,
  dense vs XAttention at --e2e-threshold (near-uniform attention: the threshold sets the density), and with
  --e2e-peer-thresholds the same XAttention engine at further thresholds (speed-up against density);
- with --model and --samples-file (RULER samples saved by `nanovllm ruler --save-samples`): end-to-end
  prefill of real prompts through a real model, one prompt at a time, dense and XAttention engines
  alternating, with the density each prompt got (real attention patterns, unlike random weights).

    PYTHONPATH=. python3 bench/sparse.py [--contexts 32768 131072] [--decode-cases 1x131072 4x131072]
        [--skip-prefill] [--skip-offload] [--skip-gpu-only] [--pages [--topk-peer]] [--async-peer]
        [--profile-kernels] [--rerank-peer N [--mass-peer]] [--key-copy-peer [8 4] [--one-stage-top-peer]
        [--copied-host-keys-peer]]
    PYTHONPATH=. python3 bench/sparse.py --model DIR --samples-file FILE [--prompts 8] --skip-prefill \
        --skip-offload --skip-gpu-only
    PYTHONPATH=. python3 bench/sparse.py --e2e-contexts 131072 [--e2e-threshold 0.2] [--e2e-chunk 32768] \
        [--e2e-peer-thresholds 0.19 0.15 0.1] --skip-prefill --skip-offload --skip-gpu-only
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from common import HERE, cuda_ms, log, require_cuda, save_results, sdpa_causal_ms
from timeline import timeline_of
from offload import ACTIVATION_GIB, CARD_GIB, measure_h2d_bandwidth, parse_cases, random_prompts, release_memory, \
    time_decode
from nanovllm import LLM, SamplingParams
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.kernels import triton_quest
from nanovllm.layers.attention import get_attention_backend
from nanovllm.layers.block_selector import DenseSelector
from nanovllm.layers.kv_access import DeviceKV
from nanovllm.layers.block_metadata import BlockKeyCopy
from nanovllm.layers.quest import QuestSelector
from nanovllm.layers.xattention import XAttentionSelector

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 256


@dataclass
class DecodePeers:
    """Which decode peers run beside dense and Quest at each budget (block selection, synchronous steps)."""

    pages: bool = False  # Quest's page selection too
    topk_peer: bool = False  # page selection through top-k + sort instead of the ordered top kernel
    async_peer: bool = False  # the block selection and key copies with async scheduling (next step launched first)
    profile_kernels: bool = False  # each peer's kernels logged
    rerank: int = 1  # > 1: page selection with quest_rerank at this factor too
    mass: bool = False  # and with quest_rerank_score "mass"
    key_copy: tuple[int, ...] = ()  # page selection through a copy of every key at these bits (quest_key_copy) too
    one_stage_top: bool = False  # the key copies' selection with the ordered top in one stage too (the old kernel)
    copied_host_keys: bool = False  # the int8 copy's peers with host pages' keys read from the copy too


class Peer(NamedTuple):
    """One decode peer: Quest at `budget` (None: dense) selecting pages or blocks, through the ordered top
    kernel or top-k + sort, with synchronous or launched (async) steps, its candidates re-ranked by their keys
    (quest_rerank, by `score`) or not, or its pages scored through a copy of every key at key_copy bits (0: none)."""

    name: str
    budget: int | None
    pages: bool = False
    ordered: bool = True
    launched: bool = False
    rerank: int = 1
    score: str = "max"
    key_copy: int = 0
    one_stage_top: bool = False
    copied_host_keys: bool = False


HOT_SHARE = 0.08  # share of key blocks per KV head that carry its query direction


def shaped_inputs(context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, 32, 128], k, v [T, 8, 128] in bf16: per KV head, keys of a random HOT_SHARE of the 128-token
    blocks (and queries everywhere) lean towards one direction, so a few blocks hold most of the mass."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    direction = F.normalize(torch.randn(KV_HEADS, DIM, device="cuda", generator=g), dim=-1) * 12
    blocks = -(-context // 128)
    hot = (torch.rand(KV_HEADS, blocks, device="cuda", generator=g) < HOT_SHARE).repeat_interleave(128, 1)[:, :context]
    k = torch.randn(context, KV_HEADS, DIM, device="cuda", generator=g) + hot.T[..., None] * direction
    q = torch.randn(context, KV_HEADS, HEADS // KV_HEADS, DIM, device="cuda", generator=g) + direction[:, None] * 0.5
    v = torch.randn(context, KV_HEADS, DIM, device="cuda", generator=g)
    return q.flatten(1, 2).bfloat16(), k.bfloat16(), v.bfloat16()


def sdpa_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[float, str]:
    """torch SDPA's faster backend on the same causal attention (GQA expanded)."""
    expand = lambda t: t.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)[None]  # noqa: E731
    return sdpa_causal_ms(q.transpose(0, 1)[None], expand(k), expand(v), scale)


def prefill_attention(context: int, threshold: float, stride: int, cover: str = "head") -> dict:
    """One layer's prefill attention over a paged cache of `context` tokens, dense and XAttention."""
    q, k, v = shaped_inputs(context, seed=context)
    blocks = -(-context // BLOCK)
    cache = PagedKVCache(1, blocks, BLOCK, KV_HEADS, DIM, torch.bfloat16, torch.device("cuda"))
    backend = get_attention_backend("triton")
    table = torch.randperm(blocks).tolist()  # a fragmented paged layout
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)]
    meta = backend.build_metadata([context], [context], [table], slots, BLOCK, torch.device("cuda"))
    scale = DIM**-0.5
    selector = XAttentionSelector(cache, None, threshold, stride, 128, min_context=0, cover=cover)
    dense = DeviceKV(cache, backend, meta, DenseSelector())
    sparse = DeviceKV(cache, backend, meta, selector)
    dense_ms = cuda_ms(lambda: dense.attend(0, q, k, v, scale), 3)
    sparse_ms = cuda_ms(lambda: sparse.attend(0, q, k, v, scale), 3)
    estimate_ms = cuda_ms(lambda: selector.select(0, q, KV_HEADS, sparse_batch(meta)), 3)
    selection = selector.select(0, q, KV_HEADS, sparse_batch(meta))[0]
    selector.fused_estimate = False  # the peer: the PyTorch path (a bmm, then the softmax-granule sums kernel)
    torch_estimate_ms = cuda_ms(lambda: selector.select(0, q, KV_HEADS, sparse_batch(meta)), 3)
    agreement = float((selector.select(0, q, KV_HEADS, sparse_batch(meta))[0] == selection).float().mean())
    selector.fused_granule_sums = False  # the peer: softmax and granule sums in PyTorch (the kernel's reference)
    torch_sums_ms = cuda_ms(lambda: selector.select(0, q, KV_HEADS, sparse_batch(meta)), 3)
    sums_agreement = float((selector.select(0, q, KV_HEADS, sparse_batch(meta))[0] == selection).float().mean())
    selector.fused_granule_sums = True
    selector.one_copy_tiles = False  # the peer: the estimate's tiles by a flip and layout copies
    flip_ms = cuda_ms(lambda: selector.select(0, q, KV_HEADS, sparse_batch(meta)), 3)
    flip_layer_ms = cuda_ms(lambda: sparse.attend(0, q, k, v, scale), 3)
    flip_agreement = float((selector.select(0, q, KV_HEADS, sparse_batch(meta))[0] == selection).float().mean())
    selector.one_copy_tiles = True
    selector.fused_estimate = None
    backend.pack_heads = True  # the peer: the prefill kernel's programs over a KV head's query heads
    packed_ms = cuda_ms(lambda: sparse.attend(0, q, k, v, scale), 3)
    packed = sparse.attend(0, q, k, v, scale).float()
    backend.pack_heads = False
    n = selection.shape[-1]
    causal = torch.arange(n, device=selection.device)[None, :] <= torch.arange(n, device=selection.device)[:, None]
    density = float((selection & causal).sum() / (causal.sum() * KV_HEADS))
    reference = dense.attend(0, q, k, v, scale).float()
    unpacked = sparse.attend(0, q, k, v, scale).float()
    error = float((unpacked - reference).abs().max())
    packed_diff = float((packed - unpacked).abs().max())
    sdpa, sdpa_name = sdpa_ms(q, k, v, scale)
    fastest_dense = min(dense_ms, sdpa)
    flops = 4 * HEADS * DIM * context * context / 2  # QK^T and PV over the causal half
    result = dict(context=context, threshold=threshold, stride=stride, cover=cover, density=density, dense_ms=dense_ms,
                  sdpa_ms=sdpa, sdpa_backend=sdpa_name, sparse_ms=sparse_ms, estimate_ms=estimate_ms,
                  torch_estimate_ms=torch_estimate_ms, selection_agreement_with_torch_estimate=agreement,
                  torch_sums_estimate_ms=torch_sums_ms, selection_agreement_with_torch_sums=sums_agreement,
                  flip_copy_estimate_ms=flip_ms, flip_copy_sparse_ms=flip_layer_ms,
                  selection_agreement_with_flip_copy=flip_agreement, packed_heads_sparse_ms=packed_ms,
                  packed_heads_max_abs_diff=packed_diff, speedup_vs_fastest_dense=fastest_dense / sparse_ms,
                  dense_tflops=flops / dense_ms / 1e9, max_abs_error_vs_dense=error)
    log(f"prefill attention {context}: dense {dense_ms:.1f} ms ({result['dense_tflops']:.0f} TFLOP/s), SDPA "
        f"{sdpa_name} {sdpa:.1f} ms; XAttention {sparse_ms:.1f} ms (estimate {estimate_ms:.1f}; the PyTorch "
        f"path's {torch_estimate_ms:.1f}, selections {agreement:.4f} equal; with PyTorch's softmax and granule "
        f"sums {torch_sums_ms:.1f}, selections {sums_agreement:.4f} equal; with flip-and-copy tiles {flip_ms:.1f}, "
        f"layer {flip_layer_ms:.1f}, selections {flip_agreement:.4f} equal; with the query heads packed per KV head "
        f"{packed_ms:.1f}, max |diff| {packed_diff:.4f}) at density {density:.3f} -> "
        f"{result['speedup_vs_fastest_dense']:.2f}x the fastest dense; max |diff| {error:.3f}")
    return result


def sparse_batch(meta):
    from nanovllm.layers.block_selector import SelectionInput

    return SelectionInput(meta.query_lens, meta.seq_lens, meta.block_size, meta.block_tables)


def prefill_requests(llm: LLM, prompts: list[list[int]], decode_steps: int) -> list[str]:
    """Run until every request has its first token, then two untimed decode steps; returns the ids. Tokens for up
    to 30 peers' decode_steps + 1 steps each."""
    params = SamplingParams(temperature=0, max_tokens=31 * decode_steps + sum(map(len, prompts)) // 4096 + 48,
                            ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in llm.step())
    for _ in range(2):
        llm.step()
    return ids


def kernel_table(llm: LLM, steps: int) -> str:
    """The kernels of `steps` decode steps (those replayed in graphs included) by device time, the step's
    host-side (CUDA API) calls and its timeline: where a step's time goes beyond its bytes' PCIe floor."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time_decode(llm, steps)
    averages = prof.key_averages()
    return (averages.table(sort_by="device_time_total", row_limit=14, max_name_column_width=70)
            + averages.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=70)
            + timeline_of(prof))


def decode_peers(llm: LLM, budgets: list[int], steps: int, h2d: float | None, which: DecodePeers,
                 copy_selectors: dict[int, QuestSelector] | None = None) -> dict:
    """ms per step with dense attention and with Quest at each budget (and the peers `which` asks for),
    on the running requests. copy_selectors: the key copy peers' by bits (`with_key_copy`)."""
    bound_selector = llm.runner.worker.selector
    out = {}
    peers = [Peer("dense", None)] + [Peer(f"quest_{b}", b) for b in budgets]
    peers += [Peer(f"quest_{b}_async", b, launched=True) for b in budgets] if which.async_peer else []
    peers += [Peer(f"quest_pages_{b}", b, pages=True) for b in budgets] if which.pages else []
    peers += [Peer(f"quest_pages_{b}_topk", b, pages=True, ordered=False) for b in budgets] if which.topk_peer else []
    peers += [Peer(f"quest_pages_{b}_rerank{which.rerank}", b, pages=True, rerank=which.rerank)
              for b in budgets] if which.rerank > 1 else []
    peers += [Peer(f"quest_pages_{b}_rerank{which.rerank}_mass", b, pages=True, rerank=which.rerank, score="mass")
              for b in budgets] if which.rerank > 1 and which.mass else []
    peers += [Peer(f"quest_pages_{b}_int{bits}_keys", b, pages=True, key_copy=bits)
              for bits in copy_selectors or {} for b in budgets]
    peers += [Peer(f"quest_pages_{b}_int{bits}_keys_async", b, pages=True, launched=True, key_copy=bits)
              for bits in copy_selectors or {} for b in budgets] if which.async_peer else []
    peers += [Peer(f"quest_pages_{b}_int{bits}_keys_one_stage_top", b, pages=True, key_copy=bits, one_stage_top=True)
              for bits in copy_selectors or {} for b in budgets] if which.one_stage_top else []
    copied = [8] if which.copied_host_keys and 8 in (copy_selectors or {}) else []
    peers += [Peer(f"quest_pages_{b}_int8_keys_host_keys_copy", b, pages=True, key_copy=8, copied_host_keys=True)
              for _ in copied for b in budgets]
    peers += [Peer(f"quest_pages_{b}_int8_keys_host_keys_copy_async", b, pages=True, launched=True, key_copy=8,
                   copied_host_keys=True) for _ in copied for b in budgets] if which.async_peer else []
    two_stage_rows = triton_quest.TWO_STAGE_MAX_ROWS
    for name, budget, page_select, ordered, launched, rerank, score, key_copy, one_stage_top, copied_keys in peers:
        triton_quest.TWO_STAGE_MAX_ROWS = 0 if one_stage_top else two_stage_rows  # read when graphs are captured
        if budget is None:
            llm.runner.set_block_selector(DenseSelector())
            llm.runner.staged_decode = False  # offload: the eager split path, at the PCIe floor
        else:
            selector = copy_selectors[key_copy] if key_copy else bound_selector
            selector.token_budget, selector.page_select, selector.ordered_top = budget, page_select, ordered
            selector.rerank, selector.rerank_score = rerank, score
            if key_copy:
                selector.copied_host_keys = copied_keys
            llm.runner.set_block_selector(selector)
            llm.runner.recapture_decode_graphs()  # the narrowed decode graphs of this budget
        llm.config = replace(llm.config, async_scheduling=launched)  # the engine reads it each step
        llm.step()  # untimed: compiles what this selection needs
        r = time_decode(llm, steps)
        if h2d and r["host_bytes_per_step"]:
            floor = 1e3 * r["host_bytes_per_step"] / h2d
            r.update(pcie_floor_ms=floor, vs_floor=r["decode_ms"] / floor,
                     achieved_gbs=r["host_bytes_per_step"] / r["decode_ms"] / 1e6)
        out[name] = r
        if which.profile_kernels:
            log(f"  kernels of {name}, {steps} steps:\n" + kernel_table(llm, steps))
    llm.config = replace(llm.config, async_scheduling=False)  # a synchronous step resolves one in flight
    triton_quest.TWO_STAGE_MAX_ROWS = two_stage_rows
    for name, r in out.items():
        if name != "dense":
            r["speedup_vs_dense"] = out["dense"]["decode_ms"] / r["decode_ms"]
        log(f"  {name}: {r['decode_ms']:.1f} ms/step ({r['graph_steps']}/{steps} in graphs), "
            f"host {r['host_bytes_per_step'] / 1e6:.0f} MB/step"
            + (f", floor {r['pcie_floor_ms']:.1f} ms -> {r['vs_floor']:.2f}x, {r['achieved_gbs']:.1f} GB/s"
               if "pcie_floor_ms" in r else "")
            + (f", {r['speedup_vs_dense']:.1f}x dense" if "speedup_vs_dense" in r else ""))
    return out


def decode_cases(config: str, cases: list[str], budgets: list[int], steps: int, offload: bool, h2d: float | None,
                 which: DecodePeers) -> list:
    probe = LLM(config, num_gpu_blocks=1, load_format="dummy", enforce_eager=True)
    max_len, vocab = probe.config.max_model_len, probe.config.hf_config["vocab_size"]
    weight_bytes = sum(p.numel() * p.element_size() for p in probe.runner.model.parameters())
    block_bytes, layers = probe.runner.bytes_per_block, probe.config.hf_config["num_hidden_layers"]
    probe = None
    release_memory()
    parsed = parse_cases(cases, max_len, steps)
    # the bound's peers on the engine's selector; the key copies' (quest_key_copy="int8", "int4") on others
    options = dict(load_format="dummy", max_model_len=max_len, sparse_policy="quest", quest_token_budget=budgets[0],
                   quest_key_copy="none")
    needed_blocks = max(b * (c + 320) for b, c in parsed) // 256 + 8
    if offload:
        device_blocks = int((CARD_GIB - weight_bytes / 2**30 - ACTIVATION_GIB) * 2**30 // block_bytes)
        host_blocks = needed_blocks - device_blocks
        options.update(num_gpu_blocks=device_blocks, enable_cpu_offload=True,
                       cpu_kv_cache_gb=host_blocks * block_bytes / 2**30)
        mirror = host_blocks * 2 * block_bytes / layers  # quest_dense_layers = 2: their host blocks on the GPU too
        bounds = (host_blocks + options["num_gpu_blocks"]) * block_bytes / 16  # min and max keys per 16 tokens
        log(f"offload: {options['num_gpu_blocks']} device blocks, host pool {options['cpu_kv_cache_gb']:.1f} GiB; "
            f"on top: mirror {mirror / 2**30:.1f} GiB, key bounds {bounds / 2**30:.1f} GiB")
    else:  # the cases' blocks, not the whole card: the key copy peer's copy comes on top
        options.update(num_gpu_blocks=needed_blocks)
    llm = LLM(config, **options)
    copy_selectors = {bits: with_key_copy(llm, bits) for bits in which.key_copy}
    results = []
    for batch, context in parsed:
        ids = prefill_requests(llm, random_prompts(vocab, batch, context, context + batch), steps)
        log(f"{'offload' if offload else 'GPU-only'} decode {batch}x{context}:")
        results.append(dict(batch=batch, context=context,
                            **decode_peers(llm, budgets, steps, h2d, which, copy_selectors)))
        for request_id in ids:
            llm.abort_request(request_id)
    llm = None
    release_memory()
    return results


def with_key_copy(llm: LLM, bits: int = 8) -> QuestSelector:
    """A second Quest selector beside the engine's, its pages scored through a copy of every key at `bits` (what
    quest_key_copy="int8" / "int4" builds), the copy registered on the cache before any prefill (it follows blocks
    to the host). Its device bytes are logged: they come on top of the card budget, as the bounds do."""
    worker, config = llm.runner.worker, llm.config
    num_host = worker.host_pool.num_host_blocks if worker.host_pool else 0
    copy = BlockKeyCopy(worker.kv_cache.data[0], num_host, config.quest_dense_layers, bits=bits)
    worker.kv_cache.hooks.append(copy)
    copy_bytes = sum(t.numel() * t.element_size() for t in (copy.codes, copy.scales, copy.host_codes, copy.host_scales))
    log(f"int{bits} key copy {copy_bytes / 2**30:.1f} GiB (device and host blocks)")
    bound = worker.selector
    return QuestSelector(copy, bound.token_budget, bound.dense_layers, bound.min_context, page_select=True,
                         max_model_len=bound.max_model_len, device_keys=bound.device_keys, host_keys=bound.host_keys)


def set_variant(llm, variant: str, threshold: float) -> None:
    """The XAttention engine as the default ("default"), with its estimate's tiles by a flip and layout copies
    ("flip_copy"), with the prefill kernel's programs over a KV head's query heads ("packed_heads"), with the
    estimate's PyTorch path instead of the Triton estimate ("torch_estimate"; flip_copy takes that path too) or at
    another threshold ("threshold_T": T instead of `threshold`)."""
    selector = llm.runner.worker.selector
    if not isinstance(selector, XAttentionSelector):
        raise TypeError(f"the XAttention engine's selector is a {type(selector).__name__}")
    selector.threshold = float(variant.removeprefix("threshold_")) if variant.startswith("threshold_") else threshold
    selector.one_copy_tiles = variant != "flip_copy"
    selector.fused_estimate = False if variant in ("torch_estimate", "flip_copy") else None
    llm.runner.worker.backend.pack_heads = variant == "packed_heads"


def e2e_prefill_random(config: str, context: int, threshold: float, cover: str = "group", reps: int = 2,
                       flip_copy_peer: bool = False, packed_heads_peer: bool = False, torch_estimate_peer: bool = False,
                       peer_thresholds: tuple[float, ...] = (), **options) -> dict:
    """End-to-end prefill (time to the first token) of one random `context`-token prompt through a model of random
    weights, dense and XAttention (sparse_min_context 0) engines alternating in one process, the first run of each
    untimed. Random weights give near-uniform attention: the fewest blocks covering `threshold` of the estimated
    mass are about that share of them, so the threshold sets the density (printed) with cover "group" (the issue's
    rule); with "head" each query head picks its own near-random share and the KV head keeps their union (about
    1 - (1 - threshold)^group). A speed measurement at a chosen density, not an accuracy one. A context at the
    model's max_position_embeddings prefills one token fewer. flip_copy_peer: the XAttention engine timed also with
    its estimate's tiles made by a flip and layout copies (`XAttentionSelector.one_copy_tiles` off);
    packed_heads_peer: also with the prefill kernel's programs over a KV head's query heads (the backend's
    `pack_heads`); torch_estimate_peer: also with the estimate's PyTorch path (`XAttentionSelector.fused_estimate`
    off: a bmm of the scores, then their softmax and granule sums); peer_thresholds: also at these thresholds (the
    same engine, its selector's threshold switched between runs), each with its density.
    options: further engine options (both engines)."""
    import time

    from nanovllm.config import load_hf_config

    max_model_len = min(context + 16, load_hf_config(config)["max_position_embeddings"])
    context = min(context, max_model_len - 1)
    block_size = options.get("kvcache_block_size", 256)
    common = dict(load_format="dummy", sparse_min_context=0, xattn_threshold=threshold, xattn_cover=cover,
                  enable_prefix_caching=False, max_model_len=max_model_len, max_num_seqs=1,
                  num_gpu_blocks=-(-max_model_len // block_size) + 2)
    engines = {name: LLM(config, sparse_policy=name, **{**common, **options}) for name in ("full", "xattention")}
    vocab = engines["full"].config.hf_config["vocab_size"]
    prompt = random_prompts(vocab, 1, context, context)[0]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    peers = {"flip_copy": flip_copy_peer, "packed_heads": packed_heads_peer, "torch_estimate": torch_estimate_peer}
    runs = [("full", "default"), ("xattention", "default")] + [("xattention", v) for v, on in peers.items() if on]
    runs += [("xattention", f"threshold_{t}") for t in peer_thresholds]
    seconds, densities = {run: [] for run in runs}, {}
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for rep in range(reps + 1):
        for name, variant in runs:
            llm = engines[name]
            if name == "xattention":
                set_variant(llm, variant, threshold)
            synchronize()
            start = time.perf_counter()
            out = llm.generate([prompt], first, use_tqdm=False)[0]
            synchronize()
            if rep:  # the first run compiles what the prompt meets
                seconds[name, variant].append(time.perf_counter() - start)
            if name == "xattention":
                densities[variant] = out.metrics.prefill_density
    density = densities["default"]
    dense, sparse = min(seconds["full", "default"]), min(seconds["xattention", "default"])
    chunk = engines["full"].config.max_num_batched_tokens
    result = dict(context=context, threshold=threshold, cover=cover, max_num_batched_tokens=chunk, density=density,
                  dense_s=dense, xattention_s=sparse, speedup=dense / sparse, runs=reps)
    peer = ""
    for name, variant in runs[2:]:
        result[f"xattention_{variant}_s"] = t = min(seconds[name, variant])
        result[f"speedup_{variant}"] = dense / t
        result[f"density_{variant}"] = densities[variant]
        peer += f"; {variant.replace('_', ' ')} {t:.2f} s at density {densities[variant]:.3f} -> {dense / t:.2f}x"
    log(f"end-to-end prefill 1 x {context} (random weights, threshold {threshold}, cover {cover}, "
        f"chunks of {chunk}): dense {dense:.2f} s, XAttention {sparse:.2f} s at density {density:.3f} -> "
        f"{dense / sparse:.2f}x{peer} (best of {reps})")
    return result


def e2e_prefill(model: str, samples_file: str, num_prompts: int, threshold: float, cover: str = "head") -> dict:
    """Time to first token of real prompts, dense vs XAttention (sparse_min_context 0), same process."""
    import time

    from nanovllm.eval.ruler.run import load_samples
    from nanovllm.eval.ruler.templates import Prompter

    samples = sorted(load_samples(samples_file), key=lambda s: -s["prompt_tokens"])[:num_prompts]
    engines = {name: LLM(model, sparse_policy=name, sparse_min_context=0, xattn_threshold=threshold, xattn_cover=cover,
                         enable_prefix_caching=False, num_gpu_blocks=256) for name in ("full", "xattention")}
    prompter = Prompter(engines["full"].tokenizer, "chat")
    prompts = [prompter.encode(s["prompt"]) for s in samples]  # as `nanovllm ruler` sends them
    first = SamplingParams(temperature=0, max_tokens=1)
    for llm in engines.values():  # every prompt once untimed: the kernel variants they meet compile here
        llm.generate(prompts, first, use_tqdm=False)
    seconds = {name: 0.0 for name in engines}
    densities = []
    for ids in prompts:
        for name, llm in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = llm.generate([ids], first, use_tqdm=False)[0]
            torch.cuda.synchronize()
            seconds[name] += time.perf_counter() - start
            if name == "xattention":
                densities.append(out.metrics.prefill_density)
    tokens = sum(map(len, prompts))
    result = dict(prompts=len(samples), tokens=tokens, dense_s=seconds["full"], xattention_s=seconds["xattention"],
                  speedup=seconds["full"] / seconds["xattention"], mean_density=sum(densities) / len(densities))
    log(f"end-to-end prefill, {len(samples)} prompts ({tokens} tokens): dense {seconds['full']:.2f} s, XAttention "
        f"{seconds['xattention']:.2f} s -> {result['speedup']:.2f}x at mean density {result['mean_density']:.3f}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "configs" / "llama-3.1-8b"))
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--cover", default="head", choices=["head", "group"], help="XAttention's xattn_cover (default: head)")
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--decode-cases", nargs="+", default=["1x131072", "4x131072"])
    ap.add_argument("--gpu-only-cases", nargs="+", default=["1x131072", "4x131072"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--pages", action="store_true", help="decode peers with Quest's page selection too")
    ap.add_argument("--topk-peer", action="store_true",
                    help="page peers also through top-k + sort instead of the ordered top kernel (kernels/triton_quest.py)")
    ap.add_argument("--async-peer", action="store_true", help="decode peers with async scheduling too")
    ap.add_argument("--one-stage-top-peer", action="store_true",
                    help="the key copy peers with the ordered top in one stage too (the kernel before two stages)")
    ap.add_argument("--copied-host-keys-peer", action="store_true",
                    help="with --key-copy-peer 8: that peer with host pages' keys read from the copy too "
                         "(quest_host_keys='copy': only values cross PCIe)")
    ap.add_argument("--profile-kernels", action="store_true", help="log each decode peer's kernels (torch.profiler)")
    ap.add_argument("--rerank-peer", type=int, default=1,
                    help="N > 1: page peers with quest_rerank=N too (candidates ranked by their keys)")
    ap.add_argument("--mass-peer", action="store_true",
                    help="with --rerank-peer: those peers with quest_rerank_score=mass too")
    ap.add_argument("--key-copy-peer", nargs="*", type=int, choices=[8, 4], default=None,
                    help="page peers with every key scored through a copy (quest_key_copy) of these bits too "
                         "(no value: 8)")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-offload", action="store_true")
    ap.add_argument("--skip-gpu-only", action="store_true")
    ap.add_argument("--model", help="a real model for the end-to-end prefill (with --samples-file)")
    ap.add_argument("--samples-file", help="RULER samples (nanovllm ruler --save-samples) for --model")
    ap.add_argument("--prompts", type=int, default=8, help="the longest N prompts of --samples-file")
    ap.add_argument("--e2e-contexts", nargs="+", type=int, default=[],
                    help="end-to-end prefill of one random prompt of each length on --config's random weights, dense "
                         "vs XAttention at --e2e-threshold (the density follows it)")
    ap.add_argument("--e2e-threshold", type=float, default=0.2)
    ap.add_argument("--e2e-peer-thresholds", nargs="+", type=float, default=[],
                    help="the end-to-end prefill's XAttention engine also at these thresholds (densities)")
    ap.add_argument("--e2e-cover", choices=("head", "group"), default="group",
                    help="xattn_cover of the random-weight prefill (group: the threshold sets the density)")
    ap.add_argument("--flip-copy-peer", action="store_true",
                    help="the end-to-end prefill's XAttention engine also with its estimate's tiles by a flip and "
                         "copies (XAttentionSelector.one_copy_tiles off)")
    ap.add_argument("--packed-heads-peer", action="store_true",
                    help="the end-to-end prefill's XAttention engine also with the prefill kernel's programs over a KV "
                         "head's query heads (the backend's pack_heads)")
    ap.add_argument("--torch-estimate-peer", action="store_true",
                    help="the end-to-end prefill's XAttention engine also with the estimate's PyTorch path "
                         "(XAttentionSelector.fused_estimate off)")
    ap.add_argument("--e2e-chunk", type=int, default=8192,
                    help="max_num_batched_tokens of both engines of the random-weight prefill (the engine's default)")
    args = ap.parse_args()
    require_cuda()
    which = DecodePeers(args.pages, args.topk_peer, args.async_peer, args.profile_kernels, args.rerank_peer,
                        args.mass_peer, () if args.key_copy_peer is None else tuple(args.key_copy_peer or [8]),
                        args.one_stage_top_peer, args.copied_host_keys_peer)
    results: dict = {}
    if not args.skip_prefill:
        results["prefill_attention"] = [prefill_attention(c, args.threshold, args.stride, args.cover) for c in args.contexts]
        release_memory()
    if not args.skip_offload:
        h2d = measure_h2d_bandwidth()
        log(f"pinned host->device bandwidth: {h2d / 1e9:.1f} GB/s")
        results["h2d_bandwidth_gbs"] = h2d / 1e9
        results["offload_decode"] = decode_cases(args.config, args.decode_cases, args.budgets, args.decode_steps,
                                                 True, h2d, which)
    if not args.skip_gpu_only:
        results["gpu_only_decode"] = decode_cases(args.config, args.gpu_only_cases, args.budgets, args.decode_steps,
                                                  False, None, which)
    for context in args.e2e_contexts:
        results.setdefault("e2e_prefill_random", []).append(e2e_prefill_random(
            args.config, context, args.e2e_threshold, args.e2e_cover, flip_copy_peer=args.flip_copy_peer,
            packed_heads_peer=args.packed_heads_peer, torch_estimate_peer=args.torch_estimate_peer,
            peer_thresholds=tuple(args.e2e_peer_thresholds), max_num_batched_tokens=args.e2e_chunk))
        release_memory()
    if args.model and args.samples_file:
        results["e2e_prefill"] = e2e_prefill(args.model, args.samples_file, args.prompts, args.threshold, args.cover)
    save_results("sparse", results)


if __name__ == "__main__":
    main()
