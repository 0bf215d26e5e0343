"""Paged KV cache: one preallocated pool per model, block tables per sequence.

The pool is ONE tensor `[layers, 2, num_blocks * block_size, kv_heads, head_dim]` (keys and
values of every layer, slot-major), allocated once at start-up. A sequence owns a list of
blocks (its block table); token i of the sequence lives in slot
`table[i // block_size] * block_size + i % block_size`. Admission reserves every block a
request can ever need (prompt + max_new_tokens + K + 1), so a running request never waits
for memory; rejection moves the length back (its slots are overwritten later); finishing,
cancelling or failing returns the blocks to the free list.

`PagedBatch` is the models' `KvStore` for one ragged forward over such sequences: it writes
the new keys/values into their slots with one `index_copy_` per layer and attends each row's
queries over that row's live slots only (gathered through its block table, padded to the
longest row of the batch, or to the graph bucket's width, and masked causally).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class KvCacheFull(Exception):
    """The pool has fewer free blocks than a reservation needs."""


@dataclass
class PagedSeq:
    """One sequence's place in the pool: its blocks and how many of its slots are live."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0


class KvPool:
    """The pool and its free list (thread-confined to the engine that owns it)."""

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

    @staticmethod
    def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return layers * 2 * block_size * kv_heads * head_dim * dtype.itemsize

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
        if more > len(self._free):
            raise KvCacheFull(f"KV cache: {tokens} tokens need {more} more blocks, {len(self._free)} free")
        for _ in range(more):
            seq.blocks.append(self._free.pop())

    def release(self, seq: PagedSeq) -> None:
        self._free.extend(reversed(seq.blocks))
        seq.blocks, seq.length = [], 0

    def slots(self, seq: PagedSeq, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 slot ids of positions start..end-1 (host tensor)."""
        positions = torch.arange(start, end)
        table = torch.tensor(seq.blocks, dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, seq: PagedSeq, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Import keys/values [Hkv, S, D] of positions 0..S-1 (the wire layout) into the slots."""
        slots = self.slots(seq, 0, keys.shape[1]).to(self.kv.device)
        self.kv[layer, 0].index_copy_(0, slots, keys.transpose(0, 1).to(self.kv))
        self.kv[layer, 1].index_copy_(0, slots, values.transpose(0, 1).to(self.kv))

    def read(self, seq: PagedSeq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [Hkv, length, D] of the live positions (the wire layout)."""
        slots = self.slots(seq, 0, seq.length).to(self.kv.device)
        return (
            self.kv[layer, 0].index_select(0, slots).transpose(0, 1).contiguous(),
            self.kv[layer, 1].index_select(0, slots).transpose(0, 1).contiguous(),
        )


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, smallest): graph shapes come from a few buckets."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


@dataclass
class BatchMeta:
    """The index tensors of one ragged forward (host or device), padded to `rows` x
    `queries` queries and `width` keys per row. Padding rows and padding queries write to
    the pool's scratch slot and attend to it; real queries attend causally to their own
    row's live slots only."""

    new_slots: torch.Tensor  # [N] int64: the slot of every new token (flattened)
    key_slots: torch.Tensor  # [R, W] int64: row r's key slots, scratch where r has fewer
    mask: torch.Tensor  # [R, 1, Q, W] bool: True = may attend
    query_index: torch.Tensor  # [R, Q] int64: flattened token of query (r, i) (0 for padding)
    flat: torch.Tensor  # [N] int64: (r, i) -> r * Q + i, back from padded to flattened

    def to(self, device) -> BatchMeta:
        return BatchMeta(*(t.to(device, non_blocking=True) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.new_slots, self.key_slots, self.mask, self.query_index, self.flat)


def batch_meta(
    pool: KvPool,
    seqs: Sequence[PagedSeq],
    new_lengths: Sequence[int],
    sliding_window: int | None,
    *,
    rows: int | None = None,
    width: int | None = None,
) -> BatchMeta:
    """Host metadata for new tokens `new_lengths[r]` at positions seqs[r].length.. ."""
    past = [s.length for s in seqs]
    live = [p + n for p, n in zip(past, new_lengths, strict=True)]
    rows = rows or len(seqs)
    width = width or max(live)
    queries = max(new_lengths)
    scratch = pool.scratch_slot
    new_slots = [pool.slots(s, p, p + n) for s, p, n in zip(seqs, past, new_lengths, strict=True)]
    pad_tokens = rows * queries - sum(new_lengths) if rows > len(seqs) else 0
    new_slots.append(torch.full((pad_tokens,), scratch, dtype=torch.int64))
    key_slots = torch.full((rows, width), scratch, dtype=torch.int64)
    query_pos = torch.full((rows, queries), -1, dtype=torch.int64)  # -1: padding query
    query_index = torch.zeros(rows, queries, dtype=torch.int64)
    start = 0
    for r, (seq, p, n, total) in enumerate(zip(seqs, past, new_lengths, live, strict=True)):
        key_slots[r, :total] = pool.slots(seq, 0, total)
        query_pos[r, :n] = torch.arange(p, p + n)
        query_index[r, :n] = torch.arange(start, start + n)
        start += n
    key_pos = torch.arange(width)[None, None, :]  # [1, 1, W]
    lives = torch.tensor(live + [0] * (rows - len(seqs)))
    allowed = (key_pos <= query_pos[:, :, None]) & (key_pos < lives[:, None, None])
    if sliding_window is not None:
        allowed &= query_pos[:, :, None] - key_pos < sliding_window
    allowed |= (query_pos < 0)[:, :, None]  # padding queries attend to everything: no NaN rows
    flat = torch.cat([torch.arange(n) + r * queries for r, n in enumerate(new_lengths)])
    if pad_tokens:  # padding rows (graph buckets): their tokens follow, in padded order
        flat = torch.arange(rows * queries)
        query_index = torch.arange(rows * queries).view(rows, queries)
    return BatchMeta(torch.cat(new_slots), key_slots, allowed[:, None], query_index, flat)


@dataclass
class PagedBatch:
    """A `KvStore` (models/llama.py) for one ragged forward over paged sequences: writes
    the new keys/values into their slots with one `index_copy_` per layer, gathers every
    row's live keys through its block table and runs one SDPA for the batch. The metadata
    is built on the host once per forward and shared by every layer; a captured graph keeps
    one static `BatchMeta` and refills it before each replay."""

    pool: KvPool
    meta: BatchMeta

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        keys, values = self.pool.kv[layer, 0], self.pool.kv[layer, 1]  # [slots, Hkv, D]
        keys.index_copy_(0, meta.new_slots, k)
        values.index_copy_(0, meta.new_slots, v)
        rows, queries = meta.query_index.shape
        q_rows = q[meta.query_index.view(-1)].view(rows, queries, *q.shape[1:])  # [R, Q, Hq, D]
        out = F.scaled_dot_product_attention(
            q_rows.transpose(1, 2),  # [R, Hq, Q, D]
            keys[meta.key_slots].transpose(1, 2),  # [R, Hkv, W, D]
            values[meta.key_slots].transpose(1, 2),
            attn_mask=meta.mask,
            enable_gqa=True,
        )  # [R, Hq, Q, D]
        return out.transpose(1, 2).reshape(rows * queries, *q.shape[1:])[meta.flat]  # [N, Hq, D]
