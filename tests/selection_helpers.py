"""Shared by the selection tests: BlockSelector.narrow's kept positions as a mask."""
import torch


def positions_mask(kept: torch.Tensor, num_columns: int) -> torch.Tensor:
    """kept [B, Hk, W] column positions (-1: none) -> [B, Hk, num_columns] bool, failing on a repeat."""
    target = kept.masked_fill(kept < 0, num_columns)
    mask = torch.zeros(*kept.shape[:2], num_columns + 1, dtype=torch.int64).scatter_add_(-1, target, torch.ones_like(kept))
    assert int(mask[..., :num_columns].max()) <= 1, "a column kept twice"
    return mask[..., :num_columns].bool()
