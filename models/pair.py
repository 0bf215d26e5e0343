"""A target/draft pair as both nodes load it, and the contract it implies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.base import CausalLM, Tokenizer
from protos.contract import Contract
from sampling import DraftToTargetMap


@dataclass(frozen=True)
class ModelPair:
    target: CausalLM
    draft: CausalLM
    d2t: DraftToTargetMap  # validated when the pair was loaded
    tokenizer: Tokenizer  # the target's

    def contract(self) -> Contract:
        return Contract(
            target_vocab_size=self.target.vocab_size,
            draft_vocab_size=self.draft.vocab_size,
            d2t=tuple(self.d2t.d2t.tolist()),
            target_model=self.target.name,
            draft_model=self.draft.name,
            kv_layout=self.target.kv_layout,
        )


def load_pair(
    corpus: Path | None = None, target_model: Path | None = None, draft_model: Path | None = None, device: str = "cpu"
) -> ModelPair:
    """HF checkpoints when both directories are given; else the built-in n-gram pair
    (the embedded default) trained on `corpus`."""
    if (target_model is None) != (draft_model is None):
        raise ValueError(
            f"models: expected both --target-model and --draft-model or neither, got "
            f"target={target_model} draft={draft_model}"
        )
    if target_model is not None:
        from models.hf import load_hf_pair

        return load_hf_pair(target_model, draft_model, device=device)
    from models.ngram import load_builtin_pair

    return load_builtin_pair(corpus)
