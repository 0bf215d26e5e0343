"""Paged KV cache: one preallocated pool per model, block tables per sequence.

The pool is ONE tensor `[layers, 2, num_blocks * block_size, kv_heads, head_dim]` (keys and
values of every layer, slot-major), allocated once at start-up. A sequence owns a list of
blocks (its block table); token i of the sequence lives in slot
`table[i // block_size] * block_size + i % block_size`. Admission reserves every block a
request can ever need (prompt + max_new_tokens + K + 1), so a running request never waits
for memory; rejection moves the length back (its slots are overwritten later); finishing,
cancelling or failing returns the blocks to the free list. The free list is shared by the
engine thread and the gRPC threads that import streamed KV (a reservation made when a
DecodeStream's header arrives), so reserving and releasing hold the pool's lock.

`PagedBatch` is the models' `KvStore` for one ragged forward over such sequences: it writes
the new keys/values into their slots with one `index_copy_` per layer and attends each row's
queries over that row's live slots only, masked causally (or by the row's tree): on a GPU with
the Triton kernel reading the slots in place (engine/triton_attention.py), elsewhere (and for
prompt chunks) by gathering them through the block table into a copy padded to the longest row
of the batch, or the graph bucket's width, and running SDPA: the torch reference.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from common.transfer import indexed, to_device


class KvCacheFull(Exception):
    """The pool has fewer free blocks than a reservation needs."""


@dataclass
class PagedSeq:
    """One sequence's place in the pool: its blocks and how many of its slots are live."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0


class KvPool:
    """The pool and its free list. Blocks are written only by their owner (the engine for an
    admitted request, an import for a reserved one), so only the free list needs the lock."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"num_blocks/block_size: expected >= 2 and >= 1, got {num_blocks}/{block_size}")
        self.layers, self.block_size, self.num_blocks = layers, block_size, num_blocks
        self.kv = torch.zeros(
            layers, 2, num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=device
        )  # [L, 2, slots, Hkv, D]
        # Block 0 is scratch: padding tokens of a graph bucket write there, and padding keys
        # read it. It is never handed out, so no request's KV is ever touched by padding.
        self.scratch_slot = 0
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack: recently freed blocks first
        self._lock = threading.Lock()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def reserve(self, seq: PagedSeq, tokens: int) -> None:
        """Grow `seq`'s table so `tokens` slots exist (KvCacheFull, and nothing taken, if not)."""
        more = self.blocks_for(tokens) - len(seq.blocks)
        if more <= 0:
            return
        with self._lock:
            if more > len(self._free):
                raise KvCacheFull(f"KV cache: {tokens} tokens need {more} more blocks, {len(self._free)} free")
            seq.blocks.extend(self._free.pop() for _ in range(more))

    def release(self, seq: PagedSeq) -> None:
        with self._lock:
            self._free.extend(reversed(seq.blocks))
        seq.blocks, seq.length = [], 0

    def slots(self, seq: PagedSeq, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 slot ids of positions start..end-1 (host tensor)."""
        return self.slots_at(seq, torch.arange(start, end))

    def move(self, seq: PagedSeq, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the KV of positions `src` to positions `dst` in every layer (an accepted
        tree path moving into line); all sources are read before any destination is written."""
        slots = to_device(self.slots_at(seq, [*src, *dst]), self.kv.device)
        self.kv[:, :, slots[len(src) :]] = self.kv[:, :, slots[: len(src)]]

    def slots_at(self, seq: PagedSeq, positions: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[len(positions)] int64 slot ids (host tensor)."""
        pos = torch.as_tensor(positions, dtype=torch.int64)
        table = torch.tensor(seq.blocks, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class BatchMeta:
    """The index tensors of one ragged forward (host or device), padded to `rows` x
    `queries` queries and `width` keys per row. Padding rows and padding queries write to
    the pool's scratch slot and attend to it; real queries attend causally to their own
    row's live slots only."""

    new_slots: torch.Tensor  # [N] int64: the slot of every new token (flattened)
    key_slots: torch.Tensor  # [R, W] int64: row r's key slots, scratch where r has fewer
    key_count: torch.Tensor  # [R] int64: row r's live keys after this forward (padding rows: W)
    mask: torch.Tensor  # [R, 1, Q, W] bool: True = may attend
    query_index: torch.Tensor  # [R, Q] int64: flattened token of query (r, i) (0 for padding)
    flat: torch.Tensor  # [N] int64: (r, i) -> r * Q + i, back from padded to flattened

    def to(self, device) -> BatchMeta:
        return BatchMeta(*(to_device(t, device) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.new_slots, self.key_slots, self.key_count, self.mask, self.query_index, self.flat)


def block_tables(seqs: Sequence[PagedSeq], rows: int, cols: int) -> np.ndarray:
    """[rows, cols] int64: row r's first `cols` blocks, 0 past them and in rows past the seqs
    (block 0 is the scratch block)."""
    tables = np.zeros((rows, cols), dtype=np.int64)
    for r, seq in enumerate(seqs):
        blocks = seq.blocks[:cols]
        tables[r, : len(blocks)] = blocks
    return tables


def batch_meta(
    pool: KvPool,
    seqs: Sequence[PagedSeq],
    new_lengths: Sequence[int],
    sliding_window: int | None,
    *,
    rows: int | None = None,
    width: int | None = None,
    tree_masks: Sequence[torch.Tensor | None] | None = None,
    queries: int | None = None,
    padded: bool = False,
) -> BatchMeta:
    """Host metadata for new tokens `new_lengths[r]` in slots seqs[r].length.. .

    padded: the tokens come in the padded `[rows, queries]` row-major layout of a graph
    bucket (row r's tokens first in its `queries` places, padding after them and in the
    padding rows); implied where `rows` exceeds the real rows. `queries` (at least the
    longest row): the bucket's queries per row.

    Vectorized over rows: one padded block-table array per batch, every slot computed from
    it by array arithmetic (no per-row tensor work), in numpy: these arrays have tens to a
    few thousand entries, where a numpy op costs a fraction of a torch CPU op's dispatch (this
    runs once per forward on the step's critical path). `tree_masks[r]` [n_r, live_r]
    replaces row r's causal mask (candidate trees: models/base.TreeSpan.mask)."""
    real = len(seqs)
    rows = rows or real
    bs, scratch = pool.block_size, pool.scratch_slot
    past = np.zeros(rows, dtype=np.int64)  # [R]
    past[:real] = [s.length for s in seqs]
    new = np.full(rows, max(new_lengths), dtype=np.int64)  # [R]
    new[:real] = new_lengths
    live = past + new
    live[real:] = 0
    width = width or int(live.max())
    queries = queries or max(new_lengths)
    # The block tables as far as the keys reach (a row's blocks past the width are never read);
    # padding rows: block 0, the scratch block.
    cols = -(-width // bs)
    tables = block_tables(seqs, rows, cols)  # [R, C]
    # every slot of every listed block, in position order: a broadcast, not a gather per key
    slots = (tables[:, :, None] * bs + np.arange(bs)).reshape(rows, cols * bs)[:, :width]  # [R, W]
    key_pos = np.arange(width)  # [W]
    key_slots = np.where(key_pos[None, :] < live[:, None], slots, scratch)  # [R, W]
    offset = np.arange(queries)[None, :]  # [1, Q]
    query_pos = np.where(offset < new[:, None], past[:, None] + offset, -1)  # [R, Q]; -1 = padding
    query_pos[real:] = -1
    valid = query_pos >= 0
    # a real query sits below its row's live length, which the width holds
    new_slots = np.where(valid, slots[np.arange(rows)[:, None], np.maximum(query_pos, 0)], scratch)  # [R, Q]
    # [R, 1, Q, W]: causal (a real query's keys up to it are live), padding queries see everything
    allowed = key_pos <= query_pos[:, None, :, None]
    if sliding_window is not None:
        allowed &= query_pos[:, None, :, None] - key_pos < sliding_window
    for r, tree in enumerate(tree_masks or ()):
        if tree is not None:
            allowed[r, 0, : tree.shape[0], : tree.shape[1]] = tree.numpy()
    allowed |= ~valid[:, None, :, None]  # padding queries attend to everything: no NaN rows
    if padded or rows > real:  # a graph bucket: tokens in padded (row-major) order
        flat = np.arange(rows * queries)
        query_index = flat.reshape(rows, queries)
        new_slots = new_slots.reshape(-1)
    else:
        flat = np.flatnonzero(valid)  # padded (r, i) of each flattened token
        starts = np.cumsum(new) - new  # [R] first flattened token of each row
        query_index = np.where(valid, starts[:, None] + offset, 0)
        new_slots = new_slots[valid]
    key_count = np.where(np.arange(rows) < real, live, width)  # padding rows attend to all W (scratch) keys
    arrays = (new_slots, key_slots, key_count, allowed, query_index, flat)
    return BatchMeta(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))


@dataclass(frozen=True)
class Shift:
    """Rows of a chain forward that sit `by[r]` (<= 0) positions before where the host put
    them: the step queued before it drafted a chain whose verification the host has not read
    yet, and assumed every draft accepted (decode_node/engine.py). The host built the forward's
    metadata at those assumed lengths; `apply` moves each row's tokens back on the device, so
    no host wait comes between the two steps. The keys past a row's true length were listed at
    the assumed lengths and are now masked; every key below it sits where the host listed it
    (a slot is a function of its position alone)."""

    by: torch.Tensor  # [R] int64 on the device, <= 0: the real rows' moves, in batch order
    tables: torch.Tensor  # [R, B] int64 on the device: each row's block table (0 past its blocks)
    rows: torch.Tensor  # [N] int64 on the device: the row of each real token
    queries: torch.Tensor  # [N] int64 on the device: its query index within the row
    at: torch.Tensor  # [N] int64 on the device: where the token sits in the flattened inputs

    @staticmethod
    def layout(
        seqs: Sequence[PagedSeq], lengths: Sequence[int], blocks: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host arrays of a shift: each real token's row [N] and query index within it [N], and
        the rows' block tables [R, B] (0 past a row's blocks; `blocks`: at most that many
        columns, as many as the forward's keys span)."""
        rows = np.repeat(np.arange(len(lengths)), lengths)  # [N]
        queries = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # [N]
        longest = max(len(s.blocks) for s in seqs)
        tables = block_tables(seqs, len(seqs), longest if blocks is None else min(longest, blocks))  # [R, B]
        return rows, queries, tables

    @classmethod
    def build(
        cls, by: torch.Tensor, seqs: Sequence[PagedSeq], lengths: Sequence[int], at: torch.Tensor | None
    ) -> Shift:
        """`at` [N] host: each real token's place in the inputs (a graph bucket's padded
        layout), None: flattened in row order. One host -> device copy."""
        rows, queries, tables = cls.layout(seqs, lengths)
        places = np.arange(len(rows)) if at is None else at.numpy()
        packed = to_device(torch.from_numpy(np.concatenate([rows, queries, places, tables.reshape(-1)])), by.device)
        n = len(rows)
        return cls(by, packed[3 * n :].view(tables.shape), packed[:n], packed[n : 2 * n], packed[2 * n : 3 * n])

    def apply(
        self, positions: torch.Tensor, seq_lens: torch.Tensor, meta: BatchMeta, block_size: int, window: int | None
    ) -> None:
        """Move the tokens' positions, row lengths, new slots, key counts and causal masks (a
        chain's: no tree masks) by `by`, in place."""
        move = self.by[self.rows]  # [N]
        positions.index_add_(0, self.at, move)  # one launch each (an indexed += is three)
        seq_lens.index_add_(0, self.at, move)
        moved = positions[self.at]
        meta.new_slots[self.at] = self.tables[self.rows, moved // block_size] * block_size + moved % block_size
        meta.key_count[: len(self.by)] += self.by
        keys = _key_positions(meta.mask.shape[-1], indexed(moved.device))  # [W]
        allowed = keys[None, :] <= moved[:, None]  # [N, W]: causal within the row's live keys
        if window is not None:
            allowed &= moved[:, None] - keys[None, :] < window
        meta.mask[self.rows, 0, self.queries] = allowed


@functools.lru_cache(maxsize=32)
def _key_positions(width: int, device: torch.device) -> torch.Tensor:
    """[width] int64 0..width-1 on `device`, never written: a replay's widths repeat (its bucket's)."""
    return torch.arange(width, device=device)


@dataclass
class PagedBatch:
    """A `KvStore` (models/llama.py) for one ragged forward over paged sequences: writes
    the new keys/values into their slots with one `index_copy_` per layer, then attends with
    `kernel` if given, else gathers every row's live keys and values through its block table
    and runs one SDPA for the batch. The metadata is built on the host once per forward and shared by every
    layer; a captured graph keeps one static `BatchMeta` and refills it before each replay.

    dense: every row brings the same number of tokens and no padding query exists in
    between (a graph bucket, or a uniform eager batch), so the flattened tokens already
    are the padded [R, Q] layout and the two reorderings are skipped."""

    pool: KvPool
    meta: BatchMeta
    dense: bool = False
    # (q_rows, cache, key_slots, key_count, mask) -> [R, Q, Hq, D]: attention reading the pool in place
    # (engine/triton_attention.paged_attention); None: the gather + SDPA below
    kernel: Callable[..., torch.Tensor] | None = None
    _grouped_mask: torch.Tensor | None = field(default=None, init=False, repr=False)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        cache = self.pool.kv[layer]  # [2, slots, Hkv, D]
        cache.index_copy_(1, meta.new_slots, kv)
        rows, queries = meta.query_index.shape
        hq, d = q.shape[1:]
        hkv = cache.shape[2]
        q_rows = q if self.dense else q[meta.query_index.view(-1)]
        q_rows = q_rows.view(rows, queries, hq, d)  # [R, Q, Hq, D]
        if self.kernel is not None:
            out = self.kernel(q_rows, cache, meta.key_slots, meta.key_count, meta.mask)
            out = out.view(rows * queries, hq, d)
            return out if self.dense else out[meta.flat]  # [N, Hq, D]
        # two dim-0 gathers: torch's vectorized gather kernel (one gather over dim 1 of `cache`
        # takes the element-wise index kernel, several times slower at batch 64)
        keys = cache[0][meta.key_slots].transpose(1, 2)  # [R, Hkv, W, D]
        values = cache[1][meta.key_slots].transpose(1, 2)
        if queries == 1:  # one query per row: SDPA's own GQA broadcast is the fastest (H200)
            out = F.scaled_dot_product_attention(
                q_rows.transpose(1, 2), keys, values, attn_mask=meta.mask, enable_gqa=True
            )  # [R, Hq, 1, D]
            out = out.reshape(rows * queries, hq, d)
        else:
            out = self._grouped(q_rows, keys, values, hkv)
        return out if self.dense else out[meta.flat]  # [N, Hq, D]

    def _grouped(self, q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hkv: int) -> torch.Tensor:
        """Several queries per row (verify, trees): the G = Hq / Hkv query heads sharing a KV
        head become G * Q queries of one head (flash-decoding's GQA packing), so SDPA's fused
        kernels see plain multi-head attention: 2.6x faster than `enable_gqa` with a mask at
        32 rows x 5 queries (H200, BENCHMARKS.md)."""
        rows, queries, hq, d = q_rows.shape
        group = hq // hkv
        if self._grouped_mask is None:  # once per forward: every layer shares it
            mask = self.meta.mask  # [R, 1, Q, W]
            self._grouped_mask = (
                mask[:, :, None]
                .expand(rows, 1, group, queries, mask.shape[-1])
                .reshape(rows, 1, group * queries, mask.shape[-1])
            )
        packed = q_rows.view(rows, queries, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(rows, hkv, group * queries, d)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=self._grouped_mask)  # [R, Hkv, G*Q, D]
        return out.view(rows, hkv, group, queries, d).permute(0, 3, 1, 2, 4).reshape(rows * queries, hq, d)
