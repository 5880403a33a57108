"""bench/quest_rules.py's replacement page scores against the engine's own (a random cache, device and host blocks)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nanovllm.layers.block_selector import DecodeLayout, SelectionInput
from nanovllm.layers.quest import QuestSelector
from test_sparse import PAGE_BS, PAGE_HK, PageStep

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from quest_rules import rule_scores  # noqa: E402


@pytest.mark.parametrize("offload", [False, True], ids=["device", "host-blocks"])
def test_group_max_rule_is_the_engines_bound_and_exact_max_its_candidate_scores(offload):
    step = PageStep(0, offload)
    step.cache.write(0, *step.new_kv(), torch.tensor(step.slots))  # the step's own token (bounds through the hook)
    batch = SelectionInput([1] * 4, step.SEQ_LENS, PAGE_BS, step.located, step.on_host)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=1000)
    selector = QuestSelector(step.bounds, token_budget=80, dense_layers=0, min_context=0, page_select=True,
                             device_keys=step.cache.data[0])
    engine = selector.batch_block_scores(0, step.q, PAGE_HK, layout, pages=True)
    torch.testing.assert_close(rule_scores("group max")(selector, 0, step.q, PAGE_HK, layout, pages=True), engine)
    if not offload:  # the key-reading rules take the device pool only
        pages = torch.arange(engine.shape[-1]).expand(4, PAGE_HK, -1).contiguous()
        want = selector.candidate_scores(0, step.q, layout, pages, 16)
        got = rule_scores("exact max")(selector, 0, step.q, PAGE_HK, layout, pages=True)
        torch.testing.assert_close(got * step.q.shape[-1] ** 0.5, want)  # the rule's logits carry the softmax scale


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mass_rerank_keeps_what_the_refine_rule_keeps(seed, monkeypatch):
    """quest_rerank_score "mass" (the engine's rerank: each query head's softmax mass among the candidates, sink and
    recent pages, the group's maximum) keeps the pages bench/quest_rules.py's "refine 2x" rule (its own definition:
    softmax over the visible pages' logits) ranks first, and the same with some blocks on the host; the choice
    differs from the "max" rerank's."""
    budget = 80  # 5 pages
    keeps = {}
    for offload in (False, True):
        step = PageStep(seed, offload)
        step.cache.write(0, *step.new_kv(), torch.tensor(step.slots))
        batch = SelectionInput([1] * 4, step.SEQ_LENS, PAGE_BS, step.located, step.on_host)
        layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=1000)
        for score in ("max", "mass"):
            selector = QuestSelector(step.bounds, token_budget=budget, dense_layers=0, min_context=0, page_select=True,
                                     rerank=2, device_keys=step.cache.data[0],
                                     host_keys=step.pool.host[0] if offload else None, rerank_score=score)
            reads = torch.zeros(4, dtype=torch.int64)
            keeps[score, offload] = selector.decode_keep(0, step.q, PAGE_HK, layout, reads)[0]
        if not offload:
            monkeypatch.setattr(QuestSelector, "batch_block_scores", rule_scores("refine 2x"))
            selector = QuestSelector(step.bounds, token_budget=budget, dense_layers=0, min_context=0, page_select=True,
                                     device_keys=step.cache.data[0])
            keeps["refine"] = selector.decode_keep(0, step.q, PAGE_HK, layout)[0]
            monkeypatch.undo()
    assert torch.equal(keeps["mass", False], keeps["refine"])
    assert torch.equal(keeps["mass", True], keeps["mass", False])
    assert not torch.equal(keeps["mass", False], keeps["max", False])


def test_channel_rules_score_with_their_channels_only(monkeypatch):
    """"sparq R" is "exact max" of each query head's q with all but its R largest |q_d| zeroed; "label R" is the
    same with one set of channels per KV head; with every channel both are "exact max" itself."""
    import quest_rules

    monkeypatch.setattr(quest_rules, "LABEL_CHANNELS", {})
    step = PageStep(1, False)
    step.cache.write(0, *step.new_kv(), torch.tensor(step.slots))
    batch = SelectionInput([1] * 4, step.SEQ_LENS, PAGE_BS, step.located, step.on_host)
    layout = DecodeLayout.build(batch, torch.device("cpu"), second_pool_base=1000)
    selector = QuestSelector(step.bounds, token_budget=80, dense_layers=0, min_context=0, page_select=True,
                             device_keys=step.cache.data[0])
    dim = step.q.shape[-1]

    def scores(rule, q=step.q):
        return rule_scores(rule)(selector, 0, q, PAGE_HK, layout, pages=True)

    exact = scores("exact max")
    torch.testing.assert_close(scores(f"sparq {dim}"), exact)
    torch.testing.assert_close(scores(f"label {dim}"), exact)
    r = dim // 4
    top = step.q.abs().topk(r, -1).indices
    kept = torch.zeros_like(step.q).scatter(-1, top, 1.0) * step.q
    torch.testing.assert_close(scores(f"sparq {r}"), scores("exact max", kept))
    assert not torch.allclose(scores(f"sparq {r}"), exact)
    got = scores(f"label {r}")
    label = quest_rules.LABEL_CHANNELS[(0, r)]  # [1, Hk, group, R]: the same channels for every head of a group
    assert torch.equal(label, label[:, :, :1].expand_as(label))
    group_kept = torch.zeros_like(step.q).view(step.q.shape[0], PAGE_HK, -1, dim).scatter(
        -1, label.expand(step.q.shape[0], -1, -1, -1), 1.0).flatten(1, 2) * step.q
    torch.testing.assert_close(got, scores("exact max", group_kept))


@pytest.mark.parametrize("kind, tolerance", [("fp8", 0.07), ("int8", 0.01), ("int4", 0.15)])
def test_quantized_key_copies_round_trip_within_their_step(kind, tolerance):
    """Each key copy's error is within its format's step of the token's largest |k_d| (keys from 0.01 to 100)."""
    from quest_rules import quantized

    k = torch.randn(64, 2, 16) * torch.logspace(-2, 2, 64)[:, None, None]
    error = (quantized(k, kind) - k).abs().amax(-1) / k.abs().amax(-1)
    assert float(error.max()) <= tolerance
    assert float(error.max()) > tolerance / 10  # not the identity
