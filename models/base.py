"""One interface for target and draft models (docs/design.md §6).

A model maps token-id histories to next-token logits. Its per-request `State` is what
the verify pass extends, rejection truncates, and the wire ships: `export_state` gives
tensors (the KV cache; none for models whose state is the token ids alone) that
`import_state` on the other node turns back into a State without recomputing the prompt.
Draft models take TARGET-vocabulary ids as input (EAGLE-style: they read the same
history as the target) and emit logits over their own vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from protos.contract import KvTensorSpec


@dataclass
class State:
    """A request's history. `tokens` are the ids the model has consumed, in order."""

    tokens: list[int] = field(default_factory=list)
    kv: object = None  # backend-specific cache; None for the n-gram models


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def incremental(self):
        """A fresh incremental detokenizer: push(ids) -> new text, flush() -> the rest."""


class CausalLM(Protocol):
    name: str  # identity that enters the contract fingerprint
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_layout: tuple[KvTensorSpec, ...]

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, State]:
        """Consume a non-empty prompt; logits [V] float32 at its last position."""

    def extend(self, state: State, ids: Sequence[int]) -> torch.Tensor:
        """Consume `ids` after the state; logits [len(ids), V] float32, one row per new
        position (row i predicts the token after ids[i]). Mutates `state`."""

    def extend_batch(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """extend() for several requests (ragged lengths) in one call."""

    def empty_state(self) -> State:
        """A state that has consumed nothing: reserve, then extend (batched prefill)."""

    def extend_last(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """extend_batch for non-empty rows, keeping only each row's last logits: [R, V] float32
        (a prefill chunk needs no logits but its last: the head is the largest matmul)."""

    def truncate(self, state: State, length: int) -> None:
        """Keep the first `length` consumed tokens (drop rejected positions)."""

    def export_state(self, state: State) -> list[torch.Tensor]:
        """The state as tensors matching `kv_layout` (SEQ = len(state.tokens))."""

    def import_state(self, tensors: Sequence[torch.Tensor], tokens: Sequence[int]) -> State:
        """Rebuild a State from export_state's tensors and the consumed tokens."""

    # KV memory. A model on a bounded pool (engine/paged_lm.py) reserves a request's KV at
    # admission and frees it when the request leaves; others grow on demand (`GrowingKv`).
    def capacity_tokens(self) -> int | None:
        """Most tokens the model's KV can ever hold for one request (None = unbounded)."""

    def can_reserve(self, tokens: int) -> bool:
        """Whether a reservation of `tokens` would succeed now."""

    def reserve(self, state: State, tokens: int) -> None:
        """Make room for `tokens` positions in `state` (raises when the pool lacks it)."""

    def release(self, state: State) -> None:
        """Give the state's KV memory back (the state is not used afterwards)."""


def check_kv_tensors(tensors: Sequence[torch.Tensor], layout: Sequence[KvTensorSpec], seq: int) -> None:
    """import_state's argument check: one tensor per spec, each of its dtype and shape at `seq`."""
    if len(tensors) != len(layout):
        raise ValueError(f"tensors: expected {len(layout)} KV tensors, got {len(tensors)}")
    for index, (tensor, spec) in enumerate(zip(tensors, layout, strict=True)):
        if tuple(tensor.shape) != spec.shape_for(seq) or tensor.dtype != spec.dtype:
            expected, got = f"{spec.dtype} {spec.shape_for(seq)}", f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(f"tensors[{index}]: expected {expected}, got {got}")


class GrowingKv:
    """The reservation methods of a model whose state grows on demand (no pool to run out of),
    and `extend_last` by way of its `extend_batch`."""

    def extend_last(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.stack([rows[-1] for rows in self.extend_batch(states, ids)])

    def capacity_tokens(self) -> int | None:
        return None

    def can_reserve(self, tokens: int) -> bool:
        return True

    def reserve(self, state: State, tokens: int) -> None:
        pass

    def release(self, state: State) -> None:
        pass
