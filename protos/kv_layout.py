"""A model's `kv_layout`: the one description of the KV tensors it exports and imports.

Each tensor is a `KvTensorSpec`, a dtype and a shape in which SEQ stands for the number of
positions. The contract fingerprints the layout (protos/contract.py), the decode node checks
received tensors against it, an import writes into storage of its shapes, and every KV size
(the bytes of a prompt's KV, the bytes a pool spends per token) is `kv_bytes` of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

SEQ = "seq"  # placeholder for the number of positions in a KV tensor's shape
T = TypeVar("T")


@dataclass(frozen=True)
class KvTensorSpec:
    """One KV tensor a model ships: dtype and shape, SEQ = number of positions."""

    dtype: torch.dtype
    shape: tuple[int | str, ...]

    def shape_for(self, seq_len: int) -> tuple[int, ...]:
        return tuple(seq_len if d == SEQ else int(d) for d in self.shape)

    def nbytes(self, seq_len: int) -> int:
        return math.prod(self.shape_for(seq_len)) * self.dtype.itemsize


def kv_bytes(layout: Iterable[KvTensorSpec], seq_len: int) -> int:
    """Bytes of the KV of `seq_len` positions; at 1, what each position costs (every tensor
    of a layout has one SEQ dimension)."""
    return sum(spec.nbytes(seq_len) for spec in layout)


def layer_kv_layout(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[KvTensorSpec, ...]:
    """The layout of a transformer's cache: per layer its keys, then its values (tensor 2l and
    2l + 1), each [kv_heads, SEQ, head_dim]."""
    return tuple(KvTensorSpec(dtype, (kv_heads, SEQ, head_dim)) for _ in range(2 * layers))


def layout_order(layers: Iterable[Iterable[T]]) -> list[T]:
    """Each layer's (keys, values) flattened into layout order: tensor 2l is layer l's keys,
    2l + 1 its values (a cache's per-layer pairs, or a paged pool's [layers, 2, ...] tensor)."""
    return [t for pair in layers for t in pair]
