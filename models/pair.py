"""A target/draft pair as both nodes load it, and the contract it implies (loading: models/loader.py)."""

from __future__ import annotations

from dataclasses import dataclass

from models.base import CausalLM, Tokenizer
from protos.contract import Contract
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
            kv_layout=self.target.kv_layout,
        )
