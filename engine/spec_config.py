"""How a node speculates: one `SpeculativeConfig`, built and validated once from the flags of
either node (pdspec/config.py), read by both engines, the launcher and GetInfo."""

from __future__ import annotations

from dataclasses import dataclass

from engine.options import ADAPTIVE_K, SPECULATIVE_METHODS
from engine.prompt_lookup import check_lookup_range
from sampling.proposal import DraftLaw
from sampling.tree import MAX_TREE_NODES


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "draft"  # SPECULATIVE_METHODS
    max_speculative_tokens: int = 8  # K of a request at most (a prefill node lowers it to its peer's)
    num_speculative_tokens: int = 4  # K of a request that does not say (clamped to the maximum)
    draft_law: DraftLaw = DraftLaw.POINT_MASS
    max_draft_candidates: int = 4  # candidates per node a request may ask for (1: chains only)
    draft_candidates: int = 1  # candidates per node of a request that does not say
    max_tree_nodes: int = MAX_TREE_NODES  # nodes of one proposal tree at most
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive_k: str = "auto"  # on | off | auto (on for prompt-lookup and hybrid)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: expected one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.max_speculative_tokens < 0:
            raise ValueError(f"max_speculative_tokens: expected >= 0, got {self.max_speculative_tokens}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens: expected >= 0, got {self.num_speculative_tokens}")
        if self.max_draft_candidates < 1:
            raise ValueError(f"max_draft_candidates: expected >= 1, got {self.max_draft_candidates}")
        if not 1 <= self.max_tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_tree_nodes: expected 1..{MAX_TREE_NODES}, got {self.max_tree_nodes}")
        if not 1 <= self.draft_candidates <= self.max_draft_candidates:
            raise ValueError(f"draft_candidates: expected 1..{self.max_draft_candidates}, got {self.draft_candidates}")
        check_lookup_range(self.prompt_lookup_min, self.prompt_lookup_max)
        if self.adaptive_k not in ADAPTIVE_K:
            raise ValueError(f"adaptive_k: expected one of {ADAPTIVE_K}, got {self.adaptive_k!r}")

    @property
    def adaptive(self) -> bool:
        """Whether each step picks each request's K (else every step drafts the request's K)."""
        if self.adaptive_k == "auto":
            return self.method not in ("draft", "eagle")
        return self.adaptive_k == "on"

    def candidates(self, trees: bool) -> int:
        """Candidates per node a node verifies and drafts: 1 where a model cannot mask by tree."""
        return self.max_draft_candidates if trees else 1

    def info(self, trees: bool, adaptive: bool) -> dict[str, object]:
        """The NodeInfo (GetInfo) fields that describe it, for a node whose models mask by tree
        or not (`trees`) and that adapts K or not."""
        return {
            "max_speculative_tokens": self.max_speculative_tokens,
            "draft_law": self.draft_law.value,
            "max_draft_candidates": self.candidates(trees),
            "max_tree_nodes": self.max_tree_nodes,
            "speculative_method": self.method,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
            "adaptive_k": adaptive,
        }
