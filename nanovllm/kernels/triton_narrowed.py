"""A narrowed decode step's per-layer tables in one Triton kernel (engine/narrowed.py).

From the kept columns as positions [B, Hk, W] (BlockSelector.narrow: ascending, -1 for none) and the
step's layout (each row's column ids, KV length and column count), one program per row writes the
kernel's per-KV-head tables [B, Hk, W] (the kept columns' ids, -1 padded) and the KV length each head
holds [B, Hk] (int32), and adds to the step's counts [B, 2] the columns kept and, with a host base,
those read from pinned host memory (ids >= base). The same numbers as `kv_access.column_tables` and
the counting in PyTorch, which take a dozen small kernels per layer; this takes one (decode steps
at 128K spend about as long on those as on the Quest scores).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.sizes import next_power_of_2
from nanovllm.kernels.triton_interpreter import patch_if_interpreting

patch_if_interpreting()

NO_HOST = -1  # host_base when no column is counted as read from the host


@triton.jit
def _narrowed_tables_kernel(
    kept_ptr, ids_ptr, seq_lens_ptr, num_columns_ptr, tables_ptr, lengths_ptr, counts_ptr,
    num_heads, width, column_size, host_base, host_column,
    stride_kb, stride_kh, stride_kw, stride_ib, stride_sb, stride_nb, stride_tb, stride_th, stride_lb, stride_cb,
    HEADS_PAD: tl.constexpr, WIDTH_PAD: tl.constexpr, COUNT_HOST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, WIDTH_PAD)
    inside = (heads < num_heads)[:, None] & (cols < width)[None, :]
    kept = tl.load(kept_ptr + row * stride_kb + heads[:, None] * stride_kh + cols[None, :] * stride_kw,
                   mask=inside, other=-1)
    held = kept >= 0
    ids = tl.load(ids_ptr + row * stride_ib + tl.where(held, kept, 0), mask=held, other=-1)
    tl.store(tables_ptr + row * stride_tb + heads[:, None] * stride_th + cols[None, :], ids, mask=inside)
    per_head = tl.sum(held.to(tl.int64), 1)
    missing = tl.load(num_columns_ptr + row * stride_nb) - per_head  # dropped columns: full ones, before the last
    lengths = tl.load(seq_lens_ptr + row * stride_sb) - missing * column_size
    tl.store(lengths_ptr + row * stride_lb + heads, lengths.to(tl.int32), mask=heads < num_heads)
    counts = counts_ptr + row * stride_cb
    tl.store(counts, tl.load(counts) + tl.sum(per_head, 0))
    if COUNT_HOST:
        on_host = tl.sum(tl.sum((held & (ids >= host_base)).to(tl.int64), 1), 0)
        tl.store(counts + host_column, tl.load(counts + host_column) + on_host)


def narrowed_tables(kept: torch.Tensor, ids: torch.Tensor, seq_lens: torch.Tensor, num_columns: torch.Tensor,
                    column_size: int, counts: torch.Tensor, host_base: int | None, host_column: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tables [B, Hk, W] int64, lengths [B, Hk] int32) of kept [B, Hk, W] over ids [B, C] int64, with
    seq_lens and num_columns [B] int64 (any strides, as kept's); counts [B, >= 2] int64 gets the kept columns
    added in column 0 and, unless host_base is None, those whose id >= host_base in column host_column.
    Shapes alone fix the launch."""
    batch, heads, width = kept.shape
    for name, t in (("kept", kept), ("ids", ids), ("seq_lens", seq_lens), ("num_columns", num_columns),
                    ("counts", counts)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    if ids.stride(-1) != 1 or counts.stride(-1) != 1:
        raise ValueError("ids and counts need contiguous rows")
    tables = torch.empty(batch, heads, width, dtype=torch.int64, device=kept.device)
    lengths = torch.empty(batch, heads, dtype=torch.int32, device=kept.device)
    _narrowed_tables_kernel[(batch,)](
        kept, ids, seq_lens, num_columns, tables, lengths, counts, heads, width, column_size,
        NO_HOST if host_base is None else host_base, host_column,
        kept.stride(0), kept.stride(1), kept.stride(2), ids.stride(0), seq_lens.stride(0), num_columns.stride(0),
        tables.stride(0), tables.stride(1), lengths.stride(0), counts.stride(0),
        HEADS_PAD=next_power_of_2(heads), WIDTH_PAD=next_power_of_2(width),
        COUNT_HOST=host_base is not None, num_warps=4,
    )
    return tables, lengths
