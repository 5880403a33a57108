"""The Triton compile watch (kernels/compile_watch.py): start-up compilations apart from request-path ones.
On the CPU the hooks are driven by hand (the interpreter compiles nothing); on CUDA an engine serving batches
of new sizes and mixed prefill/decode steps must compile nothing after its start-up (issue #18, item 4)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from nanovllm.kernels.compile_watch import CompileWatch


def compile_once(watch: CompileWatch, name: str) -> None:
    assert watch._before(repr=f"{name}[sig]", key=None) is None  # None: Triton goes on compiling
    watch._after(repr=f"{name}[sig]", fn=SimpleNamespace(name=name), key=None)


def test_request_path_compilations_are_counted_and_logged(caplog):
    watch = CompileWatch()
    watch.starting()
    compile_once(watch, "_prefill_kernel")
    with caplog.at_level(logging.INFO, logger="nanovllm.kernels"):
        watch.serving()
        assert "start-up compiled or loaded 1 Triton kernel variants" in caplog.text
        compile_once(watch, "_decode_kernel")
    assert [e.kernel for e in watch.request_path_events()] == ["_decode_kernel"]
    assert "Triton compiled _decode_kernel on the request path" in caplog.text
    watch.starting()  # a second engine in the process: its start-up is not the request path
    compile_once(watch, "_sample_kernel")
    assert [e.kernel for e in watch.request_path_events()] == ["_decode_kernel"]


def test_hooks_found_at_install_are_still_called(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append("before"))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append("after"))
    watch = CompileWatch()
    assert watch.install()
    assert knobs.runtime.jit_cache_hook == watch._before
    compile_once(watch, "k")
    assert seen == ["before", "after"] and len(watch.events) == 1


def test_events_name_what_the_variant_is_specialised_on():
    """Triton 3.6's repr lists the arguments as "q_ptr: ()"; the event takes them from the compile keywords."""
    watch = CompileWatch()
    compile = {"signature": {"q_ptr": "*bf16", "n": "i32"}, "constants": {"INDEXED": True},
               "configs": [{(1,): [["tt.divisibility", 16]]}]}
    watch._before(repr="_decode_kernel[num_warps=4](q_ptr: ()", key=None)
    watch._after(repr="_decode_kernel[num_warps=4](q_ptr: ()", fn=SimpleNamespace(name="_decode_kernel"),
                 key=None, compile=compile)
    signature = watch.events[0].signature
    assert signature.startswith("_decode_kernel[num_warps=4](") and "'n': 'i32'" in signature
    assert "'INDEXED': True" in signature and "tt.divisibility" in signature


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
@pytest.mark.parametrize("policy, key_copy", [("full", "int8"), ("xattention+quest", "int8"),
                                              ("xattention+quest", "none")])
def test_no_compilation_on_the_request_path(tiny_llama, policy, key_copy, offload):
    """Offload: a device pool of 16 blocks (256 keys) under prompts of up to 361 tokens, KV read from the host.
    Quest narrows every layer (the tiny model's two layers would otherwise be its two dense ones), through the
    int8 key copy (the default) or the bound and its rerank."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.kernels.compile_watch import WATCH

    pool = dict(num_gpu_blocks=16, enable_cpu_offload=True, cpu_kv_cache_gb=0.05) if offload else \
        dict(num_gpu_blocks=256)
    llm = LLM(str(tiny_llama), device="cuda", kvcache_block_size=16, max_num_batched_tokens=256, **pool,
              sparse_policy=policy, sparse_min_context=0, xattn_block_size=16, xattn_stride=4, quest_token_budget=32,
              quest_dense_layers=0, quest_key_copy=key_copy)
    seen = len(WATCH.request_path_events())
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=1)
    for batch in (1, 3, 17, 32):  # new batch sizes; long prompts prefill in chunks beside decoding rows
        prompts = [[(7 * i + j) % 200 + 3 for j in range(20 + 11 * i)] for i in range(batch)]
        llm.generate(prompts, [greedy if i % 2 else sampled for i in range(batch)], use_tqdm=False)
    assert [e.signature for e in WATCH.request_path_events()[seen:]] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
@pytest.mark.parametrize("key_copy", ["int8", "none"])
def test_no_compilation_on_the_request_path_at_a_large_quest_budget(tmp_path, offload, key_copy):
    """A Quest budget past the start-up's longest row (4,096 tokens): its scores (through the key copy, or the
    bound's and the rerank's) are still compiled at start-up (a Qwen RULER run at that budget compiled the bound's
    and the rerank's kernels on the request path)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.kernels.compile_watch import WATCH
    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "long", "llama", max_position_embeddings=16384)
    pool = dict(num_gpu_blocks=16, enable_cpu_offload=True, cpu_kv_cache_gb=0.05) if offload else \
        dict(num_gpu_blocks=1200)
    llm = LLM(str(model), device="cuda", kvcache_block_size=16, max_num_batched_tokens=2048, **pool,
              sparse_policy="quest", quest_token_budget=8192, quest_dense_layers=0, quest_key_copy=key_copy)
    seen = len(WATCH.request_path_events())
    prompts = [[(7 * i + j) % 200 + 3 for j in range(8400 + 50 * i)] for i in range(2)]  # narrowed rows
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(o.metrics.decode_density < 1.0 for o in out)
    assert [e.signature for e in WATCH.request_path_events()[seen:]] == []


@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
def test_start_up_mixed_step_leaves_the_engine_as_it_was(tiny_llama, offload):
    """compile_step_variants (run at start-up on CUDA) on a CPU engine: same greedy and seeded outputs after it,
    and the unseeded sampling stream is not consumed. Offload: a device pool of 8 blocks (128 keys) under the
    start-up rows of up to 511 keys."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.warm_up import compile_step_variants

    options = dict(device="cpu", kvcache_block_size=16, num_gpu_blocks=8 if offload else 64, max_num_batched_tokens=64,
                   enable_cpu_offload=offload)
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)]
    want = LLM(str(tiny_llama), **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), **options)
    compile_step_variants(llm.runner.worker)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["full", "xattention", "quest"])
def test_start_up_steps_of_a_sparse_policy_take_the_per_head_variants(tiny_llama, policy):
    """Under a sparse policy the start-up steps also attend over per-KV-head tables (prefill and decode rows),
    as the policy's selections do; under "full" they do not. The outputs after them are unchanged."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.warm_up import compile_step_variants

    options = dict(device="cpu", kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=64,
                   sparse_policy=policy)
    prompt, params = [[5, 6, 7, 8] * 10], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(tiny_llama), **options).generate(prompt, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), **options)
    backend, per_head_rows = llm.runner.worker.backend, []
    forward = backend.forward

    def recording(q, k_cache, v_cache, meta, scale):
        if meta.block_tables_tensor.dim() == 3:
            per_head_rows.append(q.shape[0])
        return forward(q, k_cache, v_cache, meta, scale)

    backend.forward = recording
    compile_step_variants(llm.runner.worker)
    backend.forward = forward
    if policy == "full":
        assert per_head_rows == []
    else:  # both layouts' rows (a 32-token prefill chunk beside decode rows), every layer, and (no decode graphs
        # on the CPU) the pure decode steps' rows
        assert sorted(set(per_head_rows)) == [1, 2, 33, 34]
    assert llm.generate(prompt, params, use_tqdm=False)[0].token_ids == want[0].token_ids


@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
@pytest.mark.parametrize("policy, key_copy", [("xattention", "none"), ("quest", "none"), ("xattention+quest", "none"),
                                              ("quest", "int8"), ("xattention+quest", "int8")])
def test_start_up_steps_run_the_policys_own_selection_below_its_minimum_context(tiny_llama, policy, key_copy,
                                                                                   offload):
    """The start-up mixed steps go through the engine's own selector with every row selecting (the default
    sparse_min_context of 8,192 set aside for them), so its kernels (XAttention's estimate, Quest's scores, top
    and rerank, or the scores through the int8 key copy) compile at start-up, the rerank counting the keys it reads
    as a request's steps do (its host-read variant: 541 ms on the request path of a Qwen RULER run); the minimum is
    back afterwards and the outputs are unchanged (offload: a device pool of 8 blocks under start-up rows of up to
    511 keys)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.warm_up import compile_step_variants
    from nanovllm.layers.quest import QuestSelector
    from nanovllm.layers.xattention import XAttentionSelector

    options = dict(device="cpu", kvcache_block_size=32, num_gpu_blocks=8 if offload else 32, max_num_batched_tokens=64,
                   enable_cpu_offload=offload,
                   sparse_policy=policy, xattn_block_size=16, xattn_stride=4, quest_token_budget=32,
                   quest_dense_layers=0, quest_key_copy=key_copy)  # 16-token pages
    prompt, params = [[5, 6, 7, 8] * 10], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(tiny_llama), **options).generate(prompt, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), **options)
    selector = llm.runner.worker.selector
    parts = [getattr(selector, "prefill", selector), getattr(selector, "decode", selector)]
    calls = {"estimate": 0, "rerank": 0, "rerank counting reads": 0, "copy": 0}

    def counting(part, method, key):
        original = getattr(part, method)

        def wrapped(*args, **kwargs):
            calls[key] += 1
            if key == "rerank" and (args[5:] or [kwargs.get("key_reads")])[0] is not None:
                calls["rerank counting reads"] += 1
            return original(*args, **kwargs)
        setattr(part, method, wrapped)

    for part in set(parts):
        if isinstance(part, XAttentionSelector):
            counting(part, "sequence_selection", "estimate")
        if isinstance(part, QuestSelector):
            counting(part, "candidate_scores", "rerank")
            counting(part, "copy_scores", "copy")
    compile_step_variants(llm.runner.worker)
    bound, copy = "quest" in policy and key_copy == "none", "quest" in policy and key_copy == "int8"
    assert calls["estimate"] > 0 if "xattention" in policy else calls["estimate"] == 0
    assert calls["rerank"] > 0 if bound else calls["rerank"] == 0
    assert calls["rerank counting reads"] > 0 if bound else calls["rerank counting reads"] == 0
    assert calls["copy"] > 0 if copy else calls["copy"] == 0
    assert all(part.min_context == 8192 for part in parts)
    assert llm.generate(prompt, params, use_tqdm=False)[0].token_ids == want[0].token_ids


def test_selector_steps_add_a_longer_row_only_where_the_selector_needs_one():
    from nanovllm.engine.warm_up import mixed_step_layouts, selector_step_layouts

    assert selector_step_layouts(32768, 0) == mixed_step_layouts(32768)
    assert selector_step_layouts(32768, 4096) == mixed_step_layouts(32768)  # the long row has 4,096 keys
    assert selector_step_layouts(32768, 8704)[-1] == ([32, 1], [32, 8704])
    assert selector_step_layouts(4096, 8704) == mixed_step_layouts(4096)  # none longer than a sequence can be


@pytest.mark.parametrize("offload", [False, True], ids=["device-only", "offload"])
def test_start_up_steps_narrow_a_row_past_a_large_budget(tmp_path, offload):
    """A budget that none of the start-up mixed steps' rows exceeds (8,192 tokens past the 4,096-key longest
    row): a further start-up step beside a longer row, so that Quest's scores and rerank still run (a Qwen
    RULER run at that budget compiled both kernels on the request path)."""
    from nanovllm import LLM
    from nanovllm.engine.warm_up import compile_step_variants, mixed_step_layouts
    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "long", "llama", max_position_embeddings=16384)
    llm = LLM(str(model), device="cpu", kvcache_block_size=32, num_gpu_blocks=8 if offload else 400,
              max_num_batched_tokens=64, enable_cpu_offload=offload, sparse_policy="quest",
              quest_token_budget=8192, quest_dense_layers=0, quest_key_copy="none")  # the bound and its rerank
    selector = llm.runner.worker.selector
    longest = max(max(seq_lens) for _, seq_lens in mixed_step_layouts(16384))
    assert not any(selector.sparse_rows(32, [longest]))  # the mixed steps alone would not narrow
    calls = {"scores": [], "rerank": 0}
    scores, rerank = selector.batch_block_scores, selector.candidate_scores

    def counting_scores(layer, q, num_kv_heads, layout, pages=False):
        calls["scores"].append(int(layout.seq_lens.max()))
        return scores(layer, q, num_kv_heads, layout, pages)

    def counting_rerank(*args, **kwargs):
        calls["rerank"] += 1
        return rerank(*args, **kwargs)
    selector.batch_block_scores, selector.candidate_scores = counting_scores, counting_rerank
    compile_step_variants(llm.runner.worker)
    assert calls["scores"] and min(calls["scores"]) == selector.warm_up_row(32) == 3 * 32 + 8192
    assert calls["rerank"] > 0


def split_variant(splits: int) -> str:
    """The decode kernel's variant for a split count: written directly (one), or merged by the merge kernel
    (triton_paged_attention.paged_decode_attention)."""
    return "direct" if splits == 1 else "merge"


@pytest.mark.parametrize("block_size, head_dim, num_kv_heads, max_len",
                         [(16, 16, 2, 512), (256, 128, 8, 131072), (256, 64, 2, 32768), (256, 64, 3, 8192)],
                         ids=["tiny", "llama-8b", "qwen-0.5b", "smollm2"])
def test_start_up_steps_meet_every_decode_variant_a_step_can_take(block_size, head_dim, num_kv_heads, max_len):
    """Every split variant a decode step of up to max_len keys can take (one split written directly; several
    merged; a pure decode step's batch-1 split at one pipeline stage) is taken by a start-up step, mixed (its decode
    rows indexed) or pure decode (the H200's 132 SMs). When the merge had a variant for more than 16 splits, rows of
    more than 4,096 keys merged through one compiled on the request path (RULER at 8K on SmolLM2: 253 ms,
    twenty-third session)."""
    tpa = pytest.importorskip("nanovllm.kernels.triton_paged_attention")
    from nanovllm.engine.warm_up import decode_step_layouts, mixed_step_layouts

    block_n = tpa.decode_tile_size(torch.bfloat16, head_dim, block_size)

    def variant(rows: int, longest: int, indexed: bool) -> tuple[str, int]:
        splits = tpa.decode_num_splits(rows, num_kv_heads, longest, block_n, num_sms=132)
        return split_variant(splits), tpa.decode_num_stages(rows, splits, indexed, False)

    for layouts, indexed in ((mixed_step_layouts(max_len), True), (decode_step_layouts(max_len), False)):
        reachable = {variant(rows, n, indexed) for rows in (1, 2, 3, 8, 64, 256)
                     for n in (1, 16, 100, 1000, 4096, 5000, 8192, 20000, 100000) if n < max_len}
        covered = set()
        for query_lens, seq_lens in layouts:
            decode = [s for q, s in zip(query_lens, seq_lens) if q == 1]
            covered.add(variant(len(decode), max(decode), indexed))
        assert reachable <= covered, (indexed, reachable - covered)


def test_start_up_rows_longer_than_the_pool_read_its_blocks_again():
    from nanovllm.engine.warm_up import warm_up_table

    assert warm_up_table(8192, 256, 16) == [b % 16 for b in range(32)]
    assert warm_up_table(100, 16, 64) == list(range(7))



def test_prefill_ladder_is_the_powers_of_two_below_the_largest_step():
    from nanovllm.engine.warm_up import prefill_ladder

    assert prefill_ladder(8192, 32768, 10**6) == [64, 128, 256, 512, 1024, 2048, 4096]
    assert prefill_ladder(8192, 1000, 10**6) == [64, 128, 256, 512]  # no longer than a sequence
    assert prefill_ladder(8192, 32768, 300) == [64, 128, 256]  # no more than the pool holds
    assert prefill_ladder(64, 4096, 10**6) == []


def test_start_up_steps_run_the_prefill_ladder(tiny_llama, monkeypatch):
    """compile_step_variants forwards one prefill row of each ladder token count (the GEMM shapes a first
    request meets), besides its mixed steps."""
    from nanovllm import LLM
    from nanovllm.engine import warm_up

    llm = LLM(str(tiny_llama), device="cpu", kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=256)
    steps = []
    mixed_step = warm_up._mixed_step
    monkeypatch.setattr(warm_up, "_mixed_step", lambda w, q, s, *a: steps.append((q, s)) or mixed_step(w, q, s, *a))
    warm_up.compile_step_variants(llm.runner.worker)
    assert [q for q, s in steps if len(q) == 1 and q != [1]] == [[64], [128]]
    assert all(q == s for q, s in steps if len(q) == 1 and q != [1])


def test_start_up_samples_greedy_and_random_rows_alone_and_together(tiny_llama, monkeypatch):
    """compile_step_variants samples one row and several, greedily (argmax: 8 ms for its kernel to load on a
    fresh H200 engine's first token) and at a temperature."""
    from nanovllm import LLM
    from nanovllm.engine import warm_up

    llm = LLM(str(tiny_llama), device="cpu", kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=64)
    calls = []
    sample = warm_up.sample_on_device
    monkeypatch.setattr(warm_up, "sample_on_device", lambda logits, params, *a: calls.append(
        (logits.shape[0], params[0].greedy)) or sample(logits, params, *a))
    warm_up.compile_step_variants(llm.runner.worker)
    assert sorted(calls) == [(1, False), (1, True), (2, False), (2, True)]  # the last mixed step: 2 rows


@pytest.mark.parametrize("graphs", [False, True])
def test_start_up_runs_pure_decode_steps_only_without_decode_graphs(tiny_llama, monkeypatch, graphs):
    """An engine without decode graphs (enforce_eager) compiled its pure decode steps' kernels on its first
    decode (459 ms on the H200): start-up runs such steps then, one split, several, and several for one row
    alone (its one-stage variant); with graphs their capture does."""
    from nanovllm import LLM
    from nanovllm.engine import warm_up

    llm = LLM(str(tiny_llama), device="cpu", kvcache_block_size=16, num_gpu_blocks=64, max_num_batched_tokens=64)
    worker = llm.runner.worker
    if graphs:
        monkeypatch.setattr(worker, "graphs", object())  # stands for captured decode graphs
    steps = []
    mixed_step = warm_up._mixed_step
    monkeypatch.setattr(warm_up, "_mixed_step", lambda w, q, s, *a: steps.append((q, s)) or mixed_step(w, q, s, *a))
    warm_up.compile_step_variants(worker)
    decode_only = [(q, s) for q, s in steps if set(q) == {1}]
    assert decode_only == ([] if graphs else [([1], [16]), ([1, 1], [16, 511]), ([1], [511])])


@pytest.mark.parametrize("policy", ["full", "quest"])
def test_start_up_of_an_offload_engine_runs_its_split_attention(tiny_llama, policy):
    """An offload engine's start-up also runs the split attention (the rows into float32 partial results, then a
    history pass merged in), over the mixed steps' rows and over decode rows alone (a mixed step's decode part: a
    Quest RULER run on Qwen compiled its one-split and 16-split variants on the request path), per KV head too
    under a sparse policy; the outputs after it are unchanged."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.warm_up import compile_step_variants

    options = dict(device="cpu", kvcache_block_size=16, num_gpu_blocks=8, enable_cpu_offload=True, cpu_kv_cache_gb=0.01,
                   max_num_batched_tokens=64, sparse_policy=policy, sparse_min_context=0)
    prompt, params = [[5, 6, 7, 8] * 40], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(tiny_llama), **options).generate(prompt, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), **options)
    backend, calls = llm.runner.worker.backend, []
    forward_with_lse, history = backend.forward_with_lse, backend.history_attention

    def recording_forward(q, k_cache, v_cache, meta, scale, out=None):
        if out is not None:
            calls.append(("rows", out[0].dtype, meta.seq_lens_tensor.dim(), max(meta.query_lens) == 1))
        return forward_with_lse(q, k_cache, v_cache, meta, scale, out=out)

    def recording_history(q, k_cache, v_cache, meta, scale, out):
        calls.append(("history", out[0].dtype, meta.seq_lens_tensor.dim(), max(meta.query_lens) == 1))
        return history(q, k_cache, v_cache, meta, scale, out)

    backend.forward_with_lse, backend.history_attention = recording_forward, recording_history
    compile_step_variants(llm.runner.worker)
    backend.forward_with_lse, backend.history_attention = forward_with_lse, history
    per_head = [1] if policy == "full" else [1, 2]
    assert sorted(set(calls)) == sorted((kind, torch.float32, d, decode_only) for kind in ("history", "rows")
                                        for d in per_head for decode_only in (False, True))
    assert len(calls) == 2 * 5 * len(per_head)  # 2 mixed and 3 decode layouts (max_model_len 512), rows and history
    assert llm.generate(prompt, params, use_tqdm=False)[0].token_ids == want[0].token_ids


@pytest.mark.parametrize("offload, policy", [(False, "full"), (True, "full"), (False, "quest")])
def test_start_up_steps_run_rope_with_and_without_the_kv_store(tiny_llama, offload, policy):
    """Device KV lets RoPE's op store k and v (its STORE variant); the offload and narrowed strategies store them in
    attend(), so their steps take RoPE's other variant: an engine that has such steps runs both at start-up."""
    from nanovllm import LLM
    from nanovllm.engine.warm_up import compile_step_variants

    llm = LLM(str(tiny_llama), device="cpu", kvcache_block_size=32, num_gpu_blocks=8 if offload else 32,
              max_num_batched_tokens=64, enable_cpu_offload=offload, sparse_policy=policy, quest_dense_layers=0)
    ops = llm.runner.worker.model.model.layers[0].self_attn.ops
    stores, original = [], ops.qk_norm_rope

    def recording(*args, store=None):
        stores.append(store is not None)
        return original(*args, store=store)
    ops.qk_norm_rope = recording
    compile_step_variants(llm.runner.worker)
    assert True in stores
    assert (False in stores) == (offload or policy != "full")
