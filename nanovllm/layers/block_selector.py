"""Block selection: which KV blocks each KV head attends to, per layer and step.

Every KV-access strategy (layers/kv_access.py, engine/offload/) asks the step's selector before it
copies or attends. A selector sees the layer, the step's queries and each sequence's blocks and
returns, per sequence, a bool mask over the sequence's blocks in position order, [num_kv_heads,
num_blocks] for all its query rows or [num_kv_heads, query blocks, num_blocks] per block of query
rows (prefill), None for a sequence it leaves whole, or None instead of the list for "every block of
every sequence" (the dense fast path). Blocks that hold the queries are
always attended to, whatever the mask says, so a selector only narrows the history that precedes
them, and the causal mask stays right when the rest is dropped.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanovllm.engine.step_plan import StepPlan
    from nanovllm.kernels.reference import KeyCodes


@dataclass(frozen=True)
class SelectionInput:
    """What a selector may look at besides the queries: per sequence, its new tokens (query rows
    cu_query_lens[i]:cu_query_lens[i+1] of q), its KV length after the step, and its blocks in position
    order (ids within their pool; on_host says which pool, None: all on the device)."""

    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    block_tables: list[list[int]]
    on_host: list[list[bool]] | None = None
    stats: SparseStats | None = None  # where a selector counts host KV it reads for its estimate
    # host blocks' keys on the device, read by the selector for this layer's estimate (the strategy then
    # copies only their values); None: the strategy does not reuse them
    host_keys: HostKeys | None = None
    # the block tables on the device, [num_seqs, max blocks] (padded with -1; 0 for host blocks), or None
    device_tables: torch.Tensor | None = None
    # with device_tables: per sequence, the positions of its host blocks in its table, [num_seqs, max host
    # blocks] on the device (padded with -1)
    host_columns: torch.Tensor | None = None
    # per sequence, its KV length once the tokens it is prefilling are all computed (the prompt's end, past
    # this chunk when the prompt is prefilled in chunks); None: each ends with this step (seq_lens)
    prefill_ends: list[int] | None = None

    def num_blocks(self, i: int) -> int:
        return -(-self.seq_lens[i] // self.block_size)

    def prefill_end(self, i: int) -> int:
        return self.seq_lens[i] if self.prefill_ends is None else self.prefill_ends[i]

    def first_query_block(self, i: int) -> int:
        """The first block holding one of sequence i's new tokens (blocks before it precede every query)."""
        return (self.seq_lens[i] - self.query_lens[i]) // self.block_size

    def query_rows(self, i: int) -> slice:
        start = sum(self.query_lens[:i])
        return slice(start, start + self.query_lens[i])


class HostKeys:
    """Host blocks' K that a selector read to the device for one layer: per read, the host ids and their
    keys [n, block_size, Hk, D] as one tensor (no per-block views)."""

    def __init__(self):
        self.reads: list[tuple[list[int], torch.Tensor]] = []
        self.row: dict[int, int] = {}  # host id -> row of the reads' keys concatenated

    def add(self, blocks: list[int], keys: torch.Tensor) -> None:
        base = len(self.row)
        self.row.update((b, base + j) for j, b in enumerate(blocks))
        self.reads.append((blocks, keys))

    def clear(self) -> None:
        self.reads.clear()
        self.row.clear()

    def __contains__(self, block: int) -> bool:
        return block in self.row

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), block_size, Hk, D]: the keys of these host blocks (all read), in order."""
        keys = self.reads[0][1] if len(self.reads) == 1 else torch.cat([k for _, k in self.reads])
        rows = torch.tensor([self.row[b] for b in blocks], dtype=torch.int64)
        return keys.index_select(0, rows.to(keys.device, non_blocking=True))


Selection = list[torch.Tensor | None]  # per sequence: bool [Hk, blocks] or [Hk, query blocks, blocks], True =
# attend; None: every block (a row the policy leaves dense)


@dataclass
class DecodeLayout:
    """A decode step's blocks as device tensors, built once per step for the selectors that select on the
    device (`BlockSelector.decode_keep`): per sequence its blocks in position order, padded to the longest.
    blocks: ids within their pool (-1: padding); ids: the kernel's table entries (host blocks as
    second_pool_base + id where the host pool is read in place); on_host, valid: [B, max blocks] bool;
    seq_lens: [B] int64; block_size: tokens per column (`at` gives the same step in smaller pages)."""

    batch: SelectionInput | None  # None when built from a graph's tensors (from_tensors); block_size: the KV block's
    blocks: torch.Tensor
    ids: torch.Tensor
    on_host: torch.Tensor
    valid: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    base: int | None = None  # ids >= base name host blocks (base + host id); None: ids are the blocks
    _paged: dict[int, DecodeLayout] = field(default_factory=dict, repr=False, compare=False)  # at(), made once

    @cached_property
    def num_blocks(self) -> torch.Tensor:
        """[B] int64: each sequence's blocks (columns), counted once per layout."""
        return self.valid.sum(1)

    def at(self, page_size: int) -> DecodeLayout:
        """This layout in pages of page_size tokens (dividing block_size): column c * P + p is page p of block
        c (P = block_size // page_size), named as in a pool viewed [blocks * P, page_size, Hk, D], the same
        memory (host pages: base + host id * P + p). Every page of a sequence's blocks is valid, those past
        its keys too (a kernel reads no key past seq_lens; the last block counts whole, as with blocks).
        Tensor operations only (they run inside CUDA graphs); made once per layout and page size."""
        if page_size == self.block_size:
            return self
        if page_size not in self._paged:
            self._paged[page_size] = self._pages(page_size)
        return self._paged[page_size]

    def _pages(self, page_size: int) -> DecodeLayout:
        per_block = self.block_size // page_size
        step = torch.arange(per_block, device=self.ids.device)
        spread = lambda t: (t[..., None] * per_block + step).flatten(1)  # noqa: E731
        repeat = lambda t: t.repeat_interleave(per_block, 1)  # noqa: E731
        valid = repeat(self.valid)
        ids = spread(self.ids)
        if self.base is not None:  # host entries: base + host page
            ids = torch.where(repeat(self.ids >= self.base), self.base + spread(self.ids - self.base), ids)
        return DecodeLayout(self.batch, torch.where(valid, spread(self.blocks), -1), ids, repeat(self.on_host), valid,
                            self.seq_lens, page_size, self.base)

    @classmethod
    def from_tensors(cls, tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     second_pool_base: int | None = None) -> DecodeLayout:
        """From a decode graph's static inputs, with no host value: tables [B, W] (entries >=
        second_pool_base name host blocks), seq_lens [B]. batch is None: callers use tensors only."""
        seq_lens = seq_lens.to(torch.int64)
        valid = torch.arange(tables.shape[1], device=tables.device)[None, :] < (-(-seq_lens // block_size))[:, None]
        on_host = tables >= second_pool_base if second_pool_base is not None else torch.zeros_like(valid)
        blocks = torch.where(on_host, tables - (second_pool_base or 0), tables)
        return cls(None, torch.where(valid, blocks, -1), tables, on_host & valid, valid, seq_lens, block_size,
                   second_pool_base)

    @classmethod
    def build(cls, batch: SelectionInput, device: torch.device, second_pool_base: int | None = None) -> DecodeLayout:
        width = max(batch.num_blocks(i) for i in range(len(batch.seq_lens)))
        ids = torch.full((len(batch.seq_lens), width), -1, dtype=torch.int64)
        on_host = torch.zeros(ids.shape, dtype=torch.bool)
        for i, table in enumerate(batch.block_tables):
            n = batch.num_blocks(i)
            ids[i, :n] = torch.tensor(table[:n], dtype=torch.int64)
            if batch.on_host is not None:
                on_host[i, :n] = torch.tensor(batch.on_host[i][:n], dtype=torch.bool)
        valid = torch.arange(width)[None, :] < torch.tensor([batch.num_blocks(i) for i in range(len(ids))])[:, None]
        entries = ids if second_pool_base is None else torch.where(on_host, ids + second_pool_base, ids)
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return cls(batch, to(ids), to(entries), to(on_host), to(valid),
                   to(torch.tensor(batch.seq_lens, dtype=torch.int64)), batch.block_size, second_pool_base)


class BlockSelector(ABC):
    name: str
    dense = False  # True: select() always returns None; strategies may then use fixed, pre-planned copies
    narrows = False  # True: narrowed_decode / narrowed_blocks / narrow are implemented (decode in graphs)

    @abstractmethod
    def select(self, layer: int, q: torch.Tensor, num_kv_heads: int, batch: SelectionInput) -> Selection | None:
        """q: [T, Hq, D] this layer's queries (post-RoPE). None: every block of every sequence."""

    def dense_for_step(self, block_size: int, query_lens: list[int], seq_lens: list[int]) -> bool:
        """True when a step of rows with these new tokens and KV lengths is known on the host to attend to
        every block in every layer: the step then runs as under a dense selector (no selection, no counts),
        and offload strategies plan and prefetch its copies once, as a dense selector's."""
        return self.dense

    def before_step(self, plan: StepPlan) -> None:
        """Host-side preparation of a step's selections before its forward pass (e.g. metadata they read)."""

    def warm_up(self, num_kv_heads: int, device: torch.device) -> None:
        """Compiles at start-up the kernel variants the selector's own kernels would otherwise compile on a
        request's first step (the engine's warm-up runs the attention variants)."""

    def warm_up_row(self, block_size: int) -> int:
        """Keys of a decode row long enough for every one of the selector's kernels to run on it in the start-up
        steps (0: any row)."""
        return 0

    @contextlib.contextmanager
    def selecting_at_any_length(self) -> Iterator[None]:
        """For the engine's start-up steps through this selector: rows shorter than the policy's minimum
        context select too, so that its own kernels run on the short start-up rows."""
        yield

    def dense_for_decode(self, block_size: int, seq_lens: list[int]) -> bool:
        """True when a decode step of sequences with these KV lengths is known on the host to attend to
        every block in every layer: the step may then run the dense decode graphs."""
        return self.dense

    def decode_keep(self, layer: int, q: torch.Tensor, num_kv_heads: int, layout: DecodeLayout,
                    key_reads: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
        """For a decode step (one query row per sequence), the selection made on the device without a
        host sync: (keep [B, Hk, columns] bool over layout.at(decode_page_size), the most columns any head
        keeps), or None for every block. Equal to select() with the query blocks switched on (where the
        columns are blocks). Selectors without it return NotImplemented and are asked select() instead.
        key_reads: as in narrow()."""
        return NotImplemented

    def decode_page_size(self, block_size: int) -> int:
        """Tokens per column of the decode masks (decode_keep, narrow, narrowed_blocks): the KV block, or
        pages it divides into (the strategies then attend over the pools viewed in pages)."""
        return block_size

    def narrowed_decode(self, block_size: int, seq_lens: list[int]) -> bool:
        """True when a decode step of sequences with these KV lengths has every row narrowed to
        `narrowed_blocks` blocks per KV head in each layer the selector narrows: the step can then run
        the narrowed decode graphs (`narrow`)."""
        return False

    def narrowed_blocks(self, block_size: int) -> int:
        """The blocks (columns of decode_page_size tokens) each KV head keeps in a narrowed decode step."""
        raise NotImplementedError

    def narrowing(self, block_size: int) -> tuple:
        """What a captured narrowed graph bakes in of this selector's state: a change replays none of them."""
        return self.narrowed_blocks(block_size), self.decode_page_size(block_size)

    def narrow_scratch_bytes(self, max_blocks: int) -> int:
        """Device bytes `narrow` takes per row of max_blocks blocks (what a graph's memory pool keeps)."""
        raise NotImplementedError

    def host_key_codes(self, layer: int) -> KeyCodes | None:
        """Where a narrowed decode step reads the keys of this layer's kept host blocks: None (from the host,
        with their values) or their int8 codes on the device (only the values then cross PCIe)."""
        return None

    def narrow(self, layer: int, q: torch.Tensor, num_kv_heads: int, layout: DecodeLayout,
               key_reads: torch.Tensor | None = None) -> torch.Tensor | None:
        """For a step `narrowed_decode` accepted: the kept columns of layout.at(decode_page_size) as positions
        [B, Hk, W] int64, W <= narrowed_blocks, ascending and then -1 in each row narrowed_decode accepts
        (any order in padding rows); from tensors alone (fixed shapes, no host value, no sync: inside a CUDA
        graph); None for a layer read whole. key_reads [B] int64 on the device, if given: each row's host
        (head, column) pairs whose keys the selection itself read from pinned memory are added to it (Quest's
        rerank candidates; the attention's own reads are counted by the caller)."""
        raise NotImplementedError


def with_query_blocks(selection: Selection, batch: SelectionInput) -> Selection:
    """The selection with every block that holds a query token switched on (see the module docstring).
    A per-sequence mask is [Hk, blocks] (every query row) or [Hk, query blocks, blocks], one row of blocks
    per block holding queries (from first_query_block on); there only the block's own diagonal is forced."""
    masks = []
    for i, mask in enumerate(selection):
        n, first = batch.num_blocks(i), batch.first_query_block(i)
        if mask is None:
            masks.append(None)
            continue
        if mask.shape[-1] != n or (mask.dim() == 3 and mask.shape[1] != n - first):
            raise ValueError(f"selection for sequence {i} has shape {tuple(mask.shape)}; it has {n} blocks, "
                             f"{n - first} of them with queries")
        mask = mask.clone()
        if mask.dim() == 2:
            mask[:, first:] = True
        else:
            mask.diagonal(first, 1, 2).fill_(True)  # not an index_put: its True would be copied from the host
        masks.append(mask)
    return masks


class SparseStats:
    """Per sequence of one step, summed over layers and KV heads: (query block, KV block) pairs attended
    and causally visible in prefill rows, KV blocks read and present in decode rows, and host KV bytes
    copied to the device for it."""

    def __init__(self, num_seqs: int):
        self.prefill = [[0, 0] for _ in range(num_seqs)]
        self.decode = [[0, 0] for _ in range(num_seqs)]
        self.host_bytes = [0] * num_seqs
        # ([B, 2] kept (head, column) pairs, those on the host; bytes per host (head, block), columns per block)
        self._on_device: list[tuple[torch.Tensor, int, int]] = []
        self._attended: list[tuple[list, int, torch.Tensor]] = []  # (prefill or decode, sequence, pairs on the device)
        self._parts: list[tuple[list[int], SparseStats]] = []  # (the step's sequences, their counts) of sub-batches
        self._key_reads: tuple[torch.Tensor, int] | None = None  # see key_reads()

    def part(self, rows: list[int]) -> SparseStats:
        """The counts of a sub-batch of the step (its sequences `rows`, in order; a part of a mixed step
        attended on its own), added into these by resolve()."""
        counts = SparseStats(len(rows))
        self._parts.append((rows, counts))
        return counts

    def add_decode_on_device(self, layout: DecodeLayout, keep: torch.Tensor, bytes_per_host_pair: int) -> None:
        """Count a device-side decode selection without a sync (added up by resolve()). keep is over
        layout's columns: a page of a block counts as that share of the block, and of its bytes."""
        num_kv_heads = keep.shape[1]
        for i in range(len(layout.batch.seq_lens)):
            self.decode[i][1] += layout.batch.num_blocks(i) * num_kv_heads
        host_pairs = (keep & layout.on_host[:, None, :]).sum((1, 2))
        per_block = layout.batch.block_size // layout.block_size
        self._on_device.append((torch.stack([keep.sum((1, 2)), host_pairs], 1), bytes_per_host_pair, per_block))

    def key_reads(self, device: torch.device, bytes_per_pair: int) -> torch.Tensor:
        """[sequences] int64 on the device, made once per step: the selections add the host (head, column)
        pairs whose keys alone they read (BlockSelector.narrow), bytes_per_pair each, added up by resolve()."""
        if self._key_reads is None:
            self._key_reads = (torch.zeros(len(self.decode), dtype=torch.int64, device=device), bytes_per_pair)
        return self._key_reads[0]

    def device_counts(self) -> list[torch.Tensor]:
        """The counts still on the device, as flat int64 tensors in the order `resolve` reads them: the parts'
        first, then the prefill and decode pairs attended, the decode selections' (kept, host) pairs, the host
        key reads."""
        counts = [t for _, part in self._parts for t in part.device_counts()]
        if self._attended:
            counts.append(torch.stack([a for *_, a in self._attended]))
        counts += [kept_and_host.flatten() for kept_and_host, _, _ in self._on_device]
        if self._key_reads is not None:
            counts.append(self._key_reads[0])
        return counts

    def resolve(self, values: Iterator[int] | None = None) -> int:
        """Add the device-side counts in, and the parts' counts; returns the host bytes they read in place.
        values: those counts on the host, in `device_counts` order; None reads them here (one sync)."""
        if values is None:
            counts = self.device_counts()
            values = iter(torch.cat(counts).tolist() if counts else [])
        total = sum(self._add_part(rows, counts, values) for rows, counts in self._parts)
        self._parts.clear()
        for counts, i, _ in self._attended:
            counts[i][0] += next(values)
        self._attended.clear()
        for kept_and_host, per_pair, per_block in self._on_device:
            for i in range(kept_and_host.shape[0]):
                kept, host_pairs = next(values), next(values)
                self.decode[i][0] += kept if per_block == 1 else kept / per_block
                self.host_bytes[i] += host_pairs * (per_pair // per_block)
                total += host_pairs * (per_pair // per_block)
        self._on_device.clear()
        if self._key_reads is not None:
            pairs, per_pair = self._key_reads
            for i in range(pairs.shape[0]):
                n = next(values)
                self.host_bytes[i] += n * per_pair
                total += n * per_pair
            self._key_reads = None
        return total

    def _add_part(self, rows: list[int], counts: SparseStats, values: Iterator[int]) -> int:
        """A part's counts added to its sequences' (resolved first); returns the host bytes it read in place."""
        in_place = counts.resolve(values)
        for i, row in enumerate(rows):
            for mine, theirs in ((self.prefill, counts.prefill), (self.decode, counts.decode)):
                mine[row][0] += theirs[i][0]
                mine[row][1] += theirs[i][1]
            self.host_bytes[row] += counts.host_bytes[i]
        return in_place

    def add(self, batch: SelectionInput, selection: Selection | None, num_kv_heads: int) -> None:
        for i in range(len(batch.seq_lens)):
            n, first = batch.num_blocks(i), batch.first_query_block(i)
            if batch.query_lens[i] == 1:
                counts, present = self.decode, n * num_kv_heads
                attended = None if selection is None or selection[i] is None else selection[i].sum()
            else:
                counts, present = self.prefill, visible_block_pairs(first, n) * num_kv_heads
                attended = None if selection is None or selection[i] is None else prefill_pairs(selection[i], first, n)
            counts[i][1] += present
            if attended is None:
                counts[i][0] += present
            else:  # counted on the device, read once per step by resolve(): no sync per layer
                self._attended.append((counts, i, attended.to(torch.int64)))


def visible_block_pairs(first: int, n: int) -> int:
    """Causal (query block, KV block) pairs of query blocks first..n-1: block b sees KV blocks 0..b."""
    return (first + 1 + n) * (n - first) // 2


def prefill_pairs(mask: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """(query block, KV block) pairs a prefill mask attends (a 0-dim tensor on the mask's device), over the
    query blocks first..n-1 (block b sees KV blocks 0..b): a [Hk, blocks] mask is shared by every query
    block, [Hk, query blocks, blocks] is not."""
    if mask.dim() == 2:
        columns = torch.arange(n, device=mask.device)
        rows_seeing = (n - torch.clamp(columns, min=first)).to(torch.int64)  # query blocks >= max(c, first)
        return (mask.to(torch.int64) * rows_seeing).sum()
    return mask.tril(first).sum()  # query block first + r sees KV blocks <= first + r


_SELECTORS: dict[str, type[BlockSelector]] = {}


def register_block_selector(name: str):
    def wrap(cls: type[BlockSelector]) -> type[BlockSelector]:
        cls.name = name
        _SELECTORS[name] = cls
        return cls

    return wrap


def get_block_selector(name: str, **options) -> BlockSelector:
    if name not in _SELECTORS:
        raise ValueError(f"unknown block selector {name!r}; available: {sorted(_SELECTORS)}")
    return _SELECTORS[name](**options)


@register_block_selector("dense")
class DenseSelector(BlockSelector):
    dense = True

    def select(self, layer, q, num_kv_heads, batch) -> None:
        return None


@register_block_selector("sink_recent")
class SinkRecentSelector(BlockSelector):
    """StreamingLLM-style: the first `sink_blocks` and the last `recent_blocks` blocks of each sequence,
    the same for every head and layer (layers < dense_layers attend to everything)."""

    def __init__(self, sink_blocks: int = 1, recent_blocks: int = 2, dense_layers: int = 0):
        if sink_blocks < 0 or recent_blocks < 1:
            raise ValueError(f"sink_blocks must be >= 0 and recent_blocks >= 1, got {sink_blocks}, {recent_blocks}")
        self.sink_blocks, self.recent_blocks, self.dense_layers = sink_blocks, recent_blocks, dense_layers

    def select(self, layer, q, num_kv_heads, batch) -> Selection | None:
        if layer < self.dense_layers:
            return None
        masks = []
        for i in range(len(batch.seq_lens)):
            n = batch.num_blocks(i)
            keep = torch.zeros(num_kv_heads, n, dtype=torch.bool)
            keep[:, : self.sink_blocks] = True
            keep[:, max(0, n - self.recent_blocks):] = True
            masks.append(keep)
        return masks


@contextlib.contextmanager
def min_context_at_zero(selector) -> Iterator[None]:
    """selector.min_context at 0 for the block: a policy's `BlockSelector.selecting_at_any_length`."""
    saved, selector.min_context = selector.min_context, 0
    try:
        yield
    finally:
        selector.min_context = saved
