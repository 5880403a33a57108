"""Quest through an int8 copy of every key (quest_key_copy="int8", layers/block_metadata.BlockKeyCopy): the copy's
round trip and its life across moves to the host, the page choice against a definition computed here, the Triton
scores against the PyTorch reference (Triton's CPU interpreter without CUDA), and the engine end to end."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanovllm import LLM
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.layers.block_metadata import BlockKeyCopy
from nanovllm.layers.block_selector import DecodeLayout, SelectionInput
from nanovllm.layers.quest import QuestSelector
from conftest import DEVICES
from test_sparse import BS, GREEDY, PAGE_BS, PAGE_HK, PROMPTS, PageStep, positions_mask, quest_llm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def quantized(keys: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """keys [..., D] as an int8 (int4) copy with one scale per row (max |k| / 127, / 7) gives them back."""
    top = 127 if bits == 8 else 7
    scale = keys.abs().amax(-1, keepdim=True) / top
    return (keys / scale).round().clamp(-top, top) * scale


def brute_force_copy_pages(keys: torch.Tensor, q: torch.Tensor, seq_len: int, budget_pages: int) -> torch.Tensor:
    """The pages [Hk, blocks * pages per block] each KV head keeps: every page of the first and the last block,
    and the budget's best pages between them by the largest q . k over the page's keys, as the int8 copy holds
    them, and the KV head's query heads."""
    num_kv_heads, group, per_block = keys.shape[1], q.shape[0] // keys.shape[1], PAGE_BS // 16
    n = -(-seq_len // PAGE_BS)
    copy = quantized(keys.float())
    keep = torch.zeros(num_kv_heads, n * per_block, dtype=torch.bool)
    keep[:, :per_block] = keep[:, (n - 1) * per_block :] = True
    for h in range(num_kv_heads):
        middle = range(per_block, (n - 1) * per_block)
        scores = torch.tensor([max(float(q[g].float() @ copy[t, h]) for g in range(h * group, (h + 1) * group)
                                   for t in range(p * 16, p * 16 + 16)) for p in middle])
        chosen = scores.topk(min(budget_pages, len(middle))).indices + per_block
        keep[h, chosen] = True
    return keep


def copy_step(seed: int, offload: bool) -> tuple[PageStep, QuestSelector]:
    step = PageStep(seed, offload, key_copy=True)
    step.cache.write(0, *step.new_kv(), torch.tensor(step.slots))
    for i, (table, flags, n) in enumerate(zip(step.located, step.on_host, step.SEQ_LENS)):
        step.bounds.fill(i, table[: (n - 1) // PAGE_BS], flags)
    return step, QuestSelector(step.bounds, token_budget=16 * 5, dense_layers=0, min_context=0, page_select=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_copy_gives_the_keys_back_within_half_a_step_and_follows_them_to_the_host(bits):
    """Each key within half its row's quantization step; a block moved to the host keeps its rows there (the
    device block then reused by other keys), and a device block written again is computed afresh. 4 bits: two
    codes per byte."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(3, 6, 32, 2, 16, torch.float32, torch.device("cpu"))
    copy = BlockKeyCopy(cache.data[0], num_host_blocks=4, first_layer=1, bits=bits)
    cache.hooks.append(copy)
    cache.data[0].copy_(torch.randn(cache.data[0].shape, generator=g) * 3)
    assert copy.codes.shape == (2, 6 * 32, 2, 16 * bits // 8) and copy.scales.shape == (2, 6 * 32, 2)
    copy.fill(7, [1, 4], None)
    for layer in (1, 2):
        got, want = copy.block_keys(layer, [4, 1], None), cache.data[0, layer, [4, 1]].flatten(0, 1)
        step = want.abs().amax(-1, keepdim=True) / (127 if bits == 8 else 7)
        assert ((got - want).abs() <= step / 2 + 1e-6).all()
        torch.testing.assert_close(got, quantized(want, bits), atol=1e-6, rtol=0)
    before = cache.data[0, :, 4].clone()
    cache.moved_to_host([(4, 2), (3, 0)])  # block 3 was never filled: the move computes it
    cache.data[0, :, [3, 4]] = torch.randn(3, 2, 32, 2, 16, generator=g)
    copy.written([3, 4])
    host = copy.block_keys(2, [2], [True])
    torch.testing.assert_close(host, quantized(before[2], bits), atol=1e-6, rtol=0)
    copy.fill(8, [4], None)
    torch.testing.assert_close(copy.block_keys(2, [4], None), quantized(cache.data[0, 2, 4], bits), atol=1e-6, rtol=0)
    assert BlockKeyCopy.bytes_per_block(2, 32, 2, 16, bits) == \
        copy.codes[:, :32].numel() + copy.scales[:, :32].numel() * 4


def test_a_four_bit_copy_packs_dimension_pairs_into_bytes():
    """Dimension 2i in a byte's low nibble, 2i + 1 in its high one, each signed (-7..7)."""
    from nanovllm.layers.block_metadata import quantize_keys, unpack_codes

    k = torch.tensor([[7.0, -7.0, 1.0, 0.0, -3.0, 2.0]])
    codes, scales = quantize_keys(k, 4)
    assert scales.tolist() == [1.0] and codes.shape == (1, 3)
    assert [c & 0xF for c in codes[0].tolist()] == [7, 1, 13] and [c >> 4 for c in codes[0].tolist()] == [-7, 0, 2]
    assert unpack_codes(codes, 4).tolist() == [[7, -7, 1, 0, -3, 2]]
    with pytest.raises(ValueError, match="8 or 4 bits per code"):
        BlockKeyCopy(torch.zeros(1, 2, 16, 1, 3), 0, bits=4)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "host-blocks"])
def test_key_copy_page_selection_equals_brute_force(seed, offload):
    """decode_keep (the step's layout) and narrow (a graph's padded tables) keep, per KV head, the definition's
    pages: the copy's exact largest score on every page, no candidates; a choice the bound does not make."""
    step, selector = copy_step(seed, offload)
    base = 1000
    batch = SelectionInput([1] * 4, step.SEQ_LENS, PAGE_BS, step.located, step.on_host)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=base)
    key_reads = torch.zeros(4, dtype=torch.int64)
    keep, _ = selector.decode_keep(0, step.q, PAGE_HK, layout, key_reads)
    want = [brute_force_copy_pages(k, q, n, 5) for k, q, n in zip(step.k, step.q, step.SEQ_LENS)]
    dropping = selector.sparse_rows(PAGE_BS, step.SEQ_LENS)
    for i, mask in enumerate(want):
        if dropping[i]:
            assert torch.equal(keep[i, :, : mask.shape[1]], mask) and not keep[i, :, mask.shape[1]:].any()
    assert key_reads.sum() == 0  # no key crosses from the host to choose
    bound_choice = PageStep(seed, offload).want_keep(5)
    assert any(not torch.equal(a, b) for a, b, d in zip(want, bound_choice, dropping) if d)
    padded = torch.full((4, 16), 39, dtype=torch.int64)
    for i, (t, f) in enumerate(zip(step.located, step.on_host)):
        padded[i, : len(t)] = torch.tensor([base + b if h else b for b, h in zip(t, f)])
    graph = DecodeLayout.from_tensors(padded, torch.tensor(step.SEQ_LENS, dtype=torch.int32), PAGE_BS, base)
    got = positions_mask(selector.narrow(0, step.q, PAGE_HK, graph), graph.at(16).ids.shape[1])
    for i, mask in enumerate(want):
        if dropping[i]:
            assert torch.equal(got[i, :, : mask.shape[1]], mask)


def test_key_copy_select_scores_blocks_as_the_layout_does():
    """select() (a decode row scored on its own) ranks blocks by the same numbers as the batched scores."""
    step, selector = copy_step(0, True)
    batch = SelectionInput([1] * 4, step.SEQ_LENS, PAGE_BS, step.located, step.on_host)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=1000)
    batched = selector.copy_scores(0, step.q, PAGE_HK, layout)
    for i, n in enumerate(step.SEQ_LENS):
        blocks = -(-n // PAGE_BS)
        one = selector.block_scores(0, step.q[i], PAGE_HK, batch, i)
        torch.testing.assert_close(one[:, : blocks - 1], batched[i, :, : blocks - 1])


def test_the_key_copy_has_nothing_to_rerank():
    with pytest.raises(ValueError, match="rerank=2: the key copy scores every page exactly"):
        QuestSelector(PageStep(0, False, key_copy=True).bounds, token_budget=32, dense_layers=0, min_context=0,
                      rerank=2)


@pytest.mark.parametrize("block_size, num_kv_heads, group, host, dtype", [
    (16, 2, 3, False, torch.float32), (32, 2, 2, True, torch.float32), (64, 1, 4, True, torch.float32),
    (48, 4, 1, True, torch.float32), (256, 2, 4, True, torch.bfloat16)])
@pytest.mark.parametrize("pages", [False, True], ids=["blocks", "pages"])
@pytest.mark.parametrize("blocks_per_program, tile, stages, bits, dim", [
    (1, 64, 2, 8, 16), (2, 128, 2, 8, 16), (4, 64, 2, 8, 16), (3, 16, 3, 8, 16),
    (2, 64, 2, 4, 32), (1, 128, 3, 4, 16)])  # 4 bits at head_dim 16: codes too narrow for a tensor-core product
def test_kernel_scores_equal_the_reference(block_size, num_kv_heads, group, host, dtype, pages, blocks_per_program,
                                           tile, stages, bits, dim):
    pytest.importorskip("triton")
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("bf16 queries: the compiled kernel's tensor-core path")
    from nanovllm.kernels.triton_quest import key_copy_scores

    g = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_host = 24, 12
    cache = PagedKVCache(2, num_blocks, block_size, num_kv_heads, dim, torch.float32, torch.device("cpu"))
    copy = BlockKeyCopy(cache.data[0], num_host, first_layer=1, bits=bits)
    cache.hooks.append(copy)
    cache.data[0].copy_(torch.randn(cache.data[0].shape, generator=g))
    seq_lens = [5 * block_size + 7, 2 * block_size, 9 * block_size + 1]  # a partial last block, a full one
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    on_host = [[host and c % 2 == 0 and c < len(t) - 1 for c in range(len(t))] for t in tables]
    hosted = {b: i for i, b in enumerate(b for t, f in zip(tables, on_host) for b, h in zip(t, f) if h)}
    if hosted:
        cache.moved_to_host(list(hosted.items()))
    located = [[hosted[b] if h else b for b, h in zip(t, f)] for t, f in zip(tables, on_host)]
    for i, (t, f) in enumerate(zip(located, on_host)):
        copy.fill(i, t, f)  # the last blocks too: the kernel and the reference score every block
    batch = SelectionInput([1] * 3, seq_lens, block_size, located, on_host if host else None)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=1 << 40 if host else None)
    q = torch.randn(3, num_kv_heads * group, dim, generator=g).to(dtype)
    want = QuestSelector(copy, 4 * block_size, 0, 0).copy_scores(1, q, num_kv_heads, layout, pages=pages)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = key_copy_scores(to(q), *map(to, copy.layer_arrays(1)), to(layout.ids), to(layout.seq_lens), block_size,
                          16, layout.base, pages=pages, blocks_per_program=blocks_per_program, tile=tile,
                          num_stages=stages, bits=bits).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-3, rtol=1e-4)
    columns = (lambda n: -(-n // 16)) if pages else (lambda n: -(-n // block_size))  # pages or blocks holding keys
    assert finite.sum() == sum(columns(n) for n in seq_lens) * num_kv_heads


@pytest.mark.parametrize("key_copy", ["int8", "int4"])
@pytest.mark.parametrize("device", DEVICES)
def test_key_copy_with_a_budget_covering_the_context_equals_full_attention(tiny_llama, device, key_copy):
    """Offload, pages: every page kept, the outputs are full attention's (the copy only chooses; on CUDA inside
    the decode graphs)."""
    options = dict(num_gpu_blocks=4, enable_cpu_offload=True, cpu_kv_cache_gb=0.01, dtype="float32", device=device)
    want = LLM(str(tiny_llama), kvcache_block_size=4 * BS, max_num_batched_tokens=64,
               **options).generate(PROMPTS, GREEDY, use_tqdm=False)
    got = quest_llm(tiny_llama, quest_token_budget=4096, quest_page_select=True, kvcache_block_size=4 * BS,
                    quest_key_copy=key_copy, **options).generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.metrics.decode_density == 1.0
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
def test_key_copy_in_the_engine_reads_the_budget_and_no_candidate_keys(tiny_llama, offload, device):
    """quest_key_copy="int8" end to end: the bound's decode density (each KV head reads the budget's pages), a
    choice of them that differs on some step, every request completes; offload: fewer host bytes than the
    bound with its rerank (which reads its candidates' keys from the host), all of them counted by the pool."""
    memory = dict(num_gpu_blocks=64)
    if offload:
        memory = dict(num_gpu_blocks=4, enable_cpu_offload=True, cpu_kv_cache_gb=0.01)
    runs = {}
    for key_copy in ("none", "int8", "int4"):
        llm = quest_llm(tiny_llama, quest_token_budget=32, quest_page_select=True, kvcache_block_size=4 * BS,
                        quest_key_copy=key_copy, dtype="float32", device=device, **memory)
        selector, chosen = llm.runner.worker.selector, []
        narrow = selector.narrow
        selector.narrow = lambda *a: chosen.append(narrow(*a)) or chosen[-1]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        pool = llm.runner.host_pool
        runs[key_copy] = (outs, [c for c in chosen if c is not None], pool.stats.h2d_bytes if pool else 0)
    bound, bound_chosen, bound_bytes = runs["none"]
    for exact, exact_chosen, exact_bytes in (runs["int8"], runs["int4"]):
        assert [o.metrics.decode_density for o in exact] == [o.metrics.decode_density for o in bound]
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in exact)
        assert exact_chosen and any(not torch.equal(a, b) for a, b in zip(bound_chosen, exact_chosen))
        assert sum(o.metrics.host_kv_bytes_read for o in exact) == exact_bytes
        assert (0 < exact_bytes < bound_bytes) if offload else exact_bytes == bound_bytes == 0


@pytest.mark.parametrize("key_copy, bits", [("int8", 8), ("int4", 4)])
def test_the_worker_budgets_the_key_copy(tiny_llama, key_copy, bits):
    """A pool sized from memory holds fewer blocks by the copy's bytes: per block, the sparse layers' codes
    (a byte per dimension, or per two) and their scales."""
    plain = quest_llm(tiny_llama, quest_token_budget=32, cpu_kv_cache_gb=0.002, quest_key_copy="none")
    copying = quest_llm(tiny_llama, quest_token_budget=32, cpu_kv_cache_gb=0.002, quest_key_copy=key_copy,
                        quest_dense_layers=1)
    layers, block_size, heads, dim = copying.runner.kv_shape
    kv = 2 * layers * block_size * heads * dim * 4
    copy = (layers - 1) * block_size * heads * (dim * bits // 8 + 4)
    budget = 0.002 * 2**30
    assert plain.runner.worker.num_blocks == int(budget // kv)
    assert copying.runner.worker.num_blocks == int(budget // (kv + copy)) < plain.runner.worker.num_blocks
    assert copying.runner.worker.selector.metadata.bits == bits


def test_a_card_the_copy_leaves_no_room_on_names_the_copy(tiny_llama, monkeypatch):
    """Offload reserves the host blocks' key copy beside the device pool: when nothing is left for the pool the
    error names the copy, its size and what frees it (a card of the copy's size, through the CUDA budget path)."""
    from nanovllm.engine.memory import kv_blocks_that_fit

    llm = quest_llm(tiny_llama, quest_token_budget=32, enable_cpu_offload=True, cpu_kv_cache_gb=0.002,
                    num_gpu_blocks=4, quest_dense_layers=1)
    worker = llm.runner.worker
    copy = worker._key_copy_bytes_per_block()
    reserved = worker._host_blocks() * copy
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reserved, reserved))  # a card the copy fills
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    with pytest.raises(ValueError, match="no memory left for the KV cache") as error:
        kv_blocks_that_fit(worker.config, torch.device("cuda"), worker.bytes_per_block + copy, reserved,
                           lambda: 0, worker._reserved_for(copy))
    message = str(error.value)
    assert f"int8 key copy of {worker._host_blocks()} host blocks" in message
    assert "quest_key_copy='int4' halves it, 'none'" in message and f"{reserved / 2**20:.1f} MiB reserved" in message
    assert "the dense layers' device copy of the host blocks (quest_dense_layers=1)" in message
    assert "int8 key copy" not in quest_llm(tiny_llama, quest_key_copy="none", enable_cpu_offload=True,
                                            cpu_kv_cache_gb=0.002, num_gpu_blocks=4).runner.worker._reserved_for(0)


def test_key_copy_kernel_compiles_for_sm90_without_a_gpu():
    """The compiled kernel (bf16 queries on tensor cores, which the interpreter does not run): Llama-3.1-8B's shape
    with pages and with blocks as columns, SmolLM2's (3 query heads per KV head, head_dim 64) in fp32, both
    shapes' 4-bit copies and the tiny test model's (head_dim 16: codes narrower than a tensor-core product); the
    request-dependent scalars opt out of specialisation."""
    pytest.importorskip("triton")
    from compiled_helpers import assert_runs_compiled

    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.triton_quest import _key_copy_scores_kernel as kernel
assert {"num_columns", "stride_tb"} <= {p.name for p in kernel.params if p.do_not_specialize}
names = kernel.arg_names
first_constexpr = names.index("GROUP")
sig = {name: "i32" for name in names[6:first_constexpr]}
sig.update(codes_ptr="*i8", scales_ptr="*fp32", tables_ptr="*i64", seq_lens_ptr="*i64", out_ptr="*fp32",
           codes_delta="i64", scales_delta="i64", base="i64")
sig.update({name: "constexpr" for name in names[first_constexpr:]})
for q, group, dim, pages, bits in [("*bf16", 4, 128, True, 8), ("*bf16", 4, 128, False, 8), ("*fp32", 3, 64, True, 8),
                                   ("*bf16", 4, 128, True, 4), ("*bf16", 3, 64, True, 4), ("*fp32", 4, 16, True, 4),
                                   ("*bf16", 4, 16, False, 4)]:
    consts = dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=dim, PAGE_SIZE=16, BLOCK_SIZE=256, TILE=128, BLOCKS=2,
                  PAGE_OUT=pages, IEEE=q == "*fp32", STAGES=2, BITS=bits)
    compiled = triton.compile(ASTSource(kernel, {**sig, "q_ptr": q}, consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    assert compiled.asm["cubin"]
print("ok")
"""
    assert_runs_compiled(code, timeout=300)


def test_the_key_copy_is_a_command_line_flag():
    import argparse

    from nanovllm.engine_args import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_options(parser.parse_args(["--quest-key-copy", "int8"])) == {"quest_key_copy": "int8"}
    assert engine_options(parser.parse_args(["--quest-host-keys", "copy"])) == {"quest_host_keys": "copy"}


def narrowed_counts(monkeypatch) -> list[list[int]]:
    """Every narrowed step's counts per row (columns read, host columns read whole, host columns read half)."""
    from nanovllm.engine.step_stats import StepWork

    seen, narrowed = [], StepWork.narrowed
    monkeypatch.setattr(StepWork, "narrowed", lambda self, plan, counts, *a: seen.extend(counts) or
                        narrowed(self, plan, counts, *a))
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_host_keys_from_the_copy_cross_pcie_as_values_alone(tiny_llama, device, monkeypatch):
    """Offload, pages, a 2-page budget: with quest_host_keys="copy" the kept host pages' keys come from the int8
    copy, so each one counts half a page's bytes (its values) and none counts whole, where "host" counts them
    whole (the same pages kept); the eager decode rows of mixed steps read half too; the requests' host bytes
    are the pool's; the tokens stay those of full keys and the logprobs move by the keys' rounding only (and do
    move: the codes are read)."""
    memory = dict(num_gpu_blocks=4, enable_cpu_offload=True, cpu_kv_cache_gb=0.01, dtype="float32", device=device)
    runs, seen = {}, narrowed_counts(monkeypatch)
    prompts = [[(7 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate((300, 260, 330))]
    for host_keys in ("host", "copy"):
        llm = quest_llm(tiny_llama, quest_token_budget=32, quest_page_select=True, kvcache_block_size=4 * BS,
                        quest_host_keys=host_keys, **memory)
        if device == "cpu":  # what a CUDA worker's limits say; without graphs the narrowed steps run eagerly
            llm.runner.planner.limits = replace(llm.runner.planner.limits, narrowed_buckets=[1, 2, 4])
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        counts = list(seen)
        seen.clear()
        pool = llm.runner.host_pool
        page_bytes = pool.block_bytes_per_layer // llm.runner.kv_shape[2] // 4
        assert sum(o.metrics.host_kv_bytes_read for o in outs) == pool.stats.h2d_bytes
        runs[host_keys] = outs, counts, pool.stats.h2d_bytes, page_bytes
    (host, host_counts, host_bytes, page_bytes), (copy, copy_counts, copy_bytes, _) = runs["host"], runs["copy"]
    assert host_counts and all(c[2] == 0 for c in host_counts) and sum(c[1] for c in host_counts) > 0
    assert copy_counts and all(c[1] == 0 for c in copy_counts) and sum(c[2] for c in copy_counts) > 0
    assert sum(c[2] for c in copy_counts) == sum(c[1] for c in host_counts)  # the same pages, half the bytes
    assert copy_bytes < host_bytes - sum(c[1] for c in host_counts) * page_bytes // 2  # eager decode rows too
    moved = 0.0
    for c, h in zip(copy, host):
        assert c.token_ids == h.token_ids
        for a, b in zip(c.outputs[0].logprobs, h.outputs[0].logprobs):
            assert a.keys() == b.keys()
            moved = max(moved, max(abs(a[t] - b[t]) for t in a))
    assert 0 < moved < 2e-2


def test_host_keys_from_the_copy_need_an_int8_copy(tiny_llama):
    with pytest.raises(ValueError, match=r"quest_host_keys='copy' .* needs quest_key_copy='int8', got 'int4'"):
        quest_llm(tiny_llama, quest_host_keys="copy", quest_key_copy="int4")
    with pytest.raises(ValueError, match=r"quest_host_keys must be one of \('host', 'copy'\)"):
        quest_llm(tiny_llama, quest_host_keys="device")
    llm = quest_llm(tiny_llama, quest_host_keys="copy")  # device-only: no host page to read
    assert not llm.runner.worker.selector.copied_host_keys
