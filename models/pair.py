"""A target/draft pair as both nodes load it, and the contract it implies (loading: models/loader.py).

The KV a request ships from the prefill node to the decode node is the pair's (`kv_layout`):
the target's, then, for a draft whose state cannot be rebuilt from the tokens (a hidden-state
head, models/eagle.py: `ships_state`), the draft's. The draft's state then rides on the
target's (`State.rides`) through export and import, so every KV transport carries both as
one list of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.base import CausalLM, State, Tokenizer
from models.kv_import import Buffer
from protos.contract import Contract
from protos.kv_layout import KvTensorSpec
from sampling import DraftToTargetMap


@dataclass(frozen=True)
class ModelPair:
    target: CausalLM
    draft: CausalLM
    d2t: DraftToTargetMap  # validated when the pair was loaded
    tokenizer: Tokenizer  # the target's

    @property
    def supports_trees(self) -> bool:
        """Both models mask by tree: requests may ask for candidate trees, not only chains."""
        return self.target.supports_trees and self.draft.supports_trees

    def contract(self) -> Contract:
        return Contract(
            target_vocab_size=self.target.vocab_size,
            draft_vocab_size=self.draft.vocab_size,
            d2t=tuple(self.d2t.d2t.tolist()),
            target_model=self.target.name,
            draft_model=self.draft.name,
            kv_layout=self.kv_layout,
        )

    @property
    def draft_ships(self) -> bool:
        """The draft's KV travels with the target's (its state needs the target's hidden states)."""
        return getattr(self.draft, "ships_state", False)

    @property
    def kv_layout(self) -> tuple[KvTensorSpec, ...]:
        """The KV tensors a request ships: the target's, then the draft's where it ships."""
        return self.target.kv_layout + (self.draft.kv_layout if self.draft_ships else ())

    def export_state(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The pair's KV tensors of a target state (and the draft state riding on it); with
        `out` (host tensors of those shapes: a shared-memory segment's), written into them."""
        own = len(self.target.kv_layout)
        tensors = self.target.export_state(state, None if out is None else out[:own])
        return tensors + self.draft_tensors(state, None if out is None else out[own:])

    def draft_tensors(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The draft's part of the pair's KV (none where the draft does not ship)."""
        if not self.draft_ships:
            return []
        if state.rides is None:
            raise ValueError("state: expected the draft's state riding on the target's (the proposer starts it)")
        return self.draft.export_state(state.rides, out)

    def begin_import(self, tokens: Sequence[int], reserve: int) -> State:
        state = self.target.begin_import(tokens, reserve)
        if self.draft_ships:
            state.rides = self.draft.begin_import(tokens, reserve)
        return state

    def import_chunk(self, state: State, index: int, offset: int, data: Buffer | torch.Tensor) -> None:
        """Bytes of KV tensor `index` of the pair's layout: the target's, or past them the draft's."""
        own = len(self.target.kv_layout)
        if index < own:
            self.target.import_chunk(state, index, offset, data)
        else:
            self.draft.import_chunk(state.rides, index - own, offset, data)

    def finish_import(self, state: State) -> None:
        self.target.finish_import(state)
        if state.rides is not None:
            self.draft.finish_import(state.rides)
