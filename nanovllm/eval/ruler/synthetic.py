"""Variable tracking (vt), common words (cwe) and frequent coded words (fwe)."""
from __future__ import annotations

import math
import random
import string

from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.common import NOISE, Draft, insert_lines, unique_names
from nanovllm.eval.ruler.templates import (
    CWE_ANSWER_PREFIX,
    CWE_TEMPLATE,
    FWE_ANSWER_PREFIX,
    FWE_TEMPLATE,
    VT_ANSWER_PREFIX,
    VT_TEMPLATE,
)

# ---- vt: one chain of 4 hops hidden in noise lines, with a one-shot example --------------------

VT_CHAINS, VT_HOPS = 1, 4
VT_EXAMPLE_LINES = 15  # noise lines of the one-shot example


def _vt_instance(rng: random.Random, noise_lines: int, chains: int, hops: int) -> tuple[str, str, str, list[str]]:
    """(task text, answer prefix, queried value, answer names) of one vt instance."""
    names = unique_names(rng, chains * (hops + 1))
    statements: list[list[str]] = []
    for c in range(chains):
        chain = names[c * (hops + 1):(c + 1) * (hops + 1)]
        value = str(rng.randint(10000, 99999))
        statements.append([f"VAR {chain[0]} = {value}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]}" for j in range(hops)])
    lines = [NOISE] * noise_lines
    for chain_statements in statements:  # each chain keeps its order; chains interleave freely
        lines, _ = insert_lines(rng, lines, chain_statements)
    query = statements[0][0].split("= ")[-1]
    text = VT_TEMPLATE.format(context="\n".join(lines), query=query)
    prefix = VT_ANSWER_PREFIX.format(num_v=hops + 1, query=query)
    return text, prefix, query, names[:hops + 1]


def make_vt(rng: random.Random, units: int, chains: int = VT_CHAINS, hops: int = VT_HOPS) -> Draft:
    ex_text, ex_prefix, _, ex_names = _vt_instance(rng, VT_EXAMPLE_LINES, chains, hops)
    text, prefix, _, names = _vt_instance(rng, units, chains, hops)
    example = ex_text + ex_prefix + " ".join(ex_names)
    return Draft(example + "\n\n" + text, prefix, names)


# ---- cwe: 10 words repeated 30 times among words repeated 3 times ------------------------------

CWE_COMMON = 10


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_list(rng: random.Random, num_words: int, common_reps: int, other_reps: int) -> tuple[str, list[str]]:
    words = rng.sample(data.common_vocabulary(), num_words)
    common, others = words[:CWE_COMMON], words[CWE_COMMON:]
    sequence = common * common_reps + others * other_reps
    rng.shuffle(sequence)
    return _numbered(sequence), common


def make_cwe(rng: random.Random, units: int, length: int) -> Draft:
    """``units`` distinct words; below 4K tokens RULER's lighter repetition (6/1, example 20 words 3/1)."""
    small = length < 4096
    ex_context, ex_common = _cwe_list(rng, 20 if small else 40, 3 if small else 10, 1 if small else 3)
    context, common = _cwe_list(rng, units, 6 if small else 30, 1 if small else 3)
    example = CWE_TEMPLATE.format(context=ex_context) + CWE_ANSWER_PREFIX + " " + _numbered(ex_common)
    return Draft(example + "\n\n" + CWE_TEMPLATE.format(context=context), CWE_ANSWER_PREFIX, common)


# ---- fwe: Zipf-distributed coded words; the most frequent is the noise "..." --------------------

FWE_ALPHA = 2.0
FWE_WORD_LEN = 6
ZETA_2 = math.pi ** 2 / 6  # zeta(FWE_ALPHA)


def fwe_vocab_size(length: int, max_new_tokens: int = 50) -> int:
    return max(8, (length - max_new_tokens) // 50)


def make_fwe(rng: random.Random, units: int, length: int) -> Draft:
    """``units`` scales the Zipf counts: word k (1-based rank) appears floor(units * k^-2 / zeta(2)) times."""
    size = fwe_vocab_size(length)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN)) for _ in range(size)]
    while len(set(vocab)) < size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN)))
    vocab = sorted(set(vocab))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise
    words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(units * k ** -FWE_ALPHA / ZETA_2))]
    rng.shuffle(words)
    return Draft(FWE_TEMPLATE.format(context=" ".join(words)), FWE_ANSWER_PREFIX, vocab[1:4])
