"""bench/quest_rules.py's replacement page scores against the engine's own (a random cache, device and host blocks)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nanovllm.layers.block_selector import DecodeLayout, SelectionInput
from nanovllm.layers.sparse_policies import QuestSelector
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
