"""Tensor-parallel layers. Column-parallel projections need no layer of their own: each rank holds an
nn.Linear of its output columns (the loader cuts them). Row-parallel ones sum partial products over the
ranks; the vocabulary is split in rows for the embedding (masked lookup, summed) and the LM head (logits
gathered on rank 0). Used only when tensor_parallel_size > 1: with one rank the models build plain
nn.Linear / nn.Embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.parallel_state import TensorParallel, all_reduce, gather_to_driver
from nanovllm.distributed.sharding import vocab_range


class RowParallelLinear(nn.Linear):
    """Each rank holds in_features / N input columns of W; partial products are summed, then the bias added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary; ids outside them give zeros, and the sum over ranks is the lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        self.start, rows = vocab_range(vocab_size, tp)
        super().__init__(rows, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(inside, local, 0), self.weight)
        return all_reduce(x.masked_fill(~inside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary rows of the head; rank 0 gets the full logits [T, V], other ranks their own part."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel):
        _, rows = vocab_range(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size, self.tp, self.padded_rows = vocab_size, tp, -(-vocab_size // tp.size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.out_features < self.padded_rows:
            logits = F.pad(logits, (0, self.padded_rows - self.out_features))
        gathered = gather_to_driver(logits.contiguous(), self.tp)
        return gathered[:, : self.vocab_size] if self.tp.is_driver else logits


def row_parallel_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> nn.Linear:
    cls = nn.Linear if tp.size == 1 else RowParallelLinear
    return cls(in_features, out_features, bias=bias)


def embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Embedding:
    return nn.Embedding(vocab_size, hidden_size) if tp.size == 1 else VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(hidden_size: int, vocab_size: int, tp: TensorParallel) -> nn.Linear:
    return nn.Linear(hidden_size, vocab_size, bias=False) if tp.size == 1 else ParallelLMHead(hidden_size, vocab_size, tp)
