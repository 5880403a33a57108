"""qa_1 (SQuAD v2 dev) and qa_2 (HotpotQA dev distractor): gold documents among distractors."""
from __future__ import annotations

import random

from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.common import Draft
from nanovllm.eval.ruler.templates import QA_ANSWER_PREFIX, QA_TEMPLATE

DOCUMENT = "Document {i}:\n{text}"
DATASETS = {"squad": data.squad, "hotpotqa": data.hotpotqa}


def pick_documents(rng: random.Random, qa: data.QASet, item: data.QAItem, num_docs: int) -> list[int]:
    """Gold documents, then the item's related ones, then random others, ``num_docs`` in all (unshuffled)."""
    gold = list(item.gold)
    need = max(0, min(num_docs, len(qa.documents)) - len(gold))
    related = [i for i in item.related if i not in gold]
    if need <= len(related):
        return gold + rng.sample(related, need)
    taken = set(gold) | set(related)
    need -= len(related)
    candidates = rng.sample(range(len(qa.documents)), min(len(qa.documents), need + len(taken)))
    return gold + related + [i for i in candidates if i not in taken][:need]


def make_qa(dataset: str, rng: random.Random, units: int, index: int) -> Draft:
    """Question ``index`` (file order, wrapping around) with ``units`` documents."""
    qa = DATASETS[dataset]()
    item = qa.items[index % len(qa.items)]
    docs = [qa.documents[i] for i in pick_documents(rng, qa, item, units)]
    rng.shuffle(docs)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, text=d) for i, d in enumerate(docs))
    return Draft(QA_TEMPLATE.format(context=context, query=item.query), QA_ANSWER_PREFIX, list(item.answers),
                 {"question": item.query})
