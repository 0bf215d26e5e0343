"""Prompt lookup and hybrid drafting, and the one place a node's proposer is built from its
`SpeculativeConfig` (`proposer_for`)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.draft_model import DraftModelProposer
from engine.eagle import EAGLE, EagleProposer
from engine.prompt_lookup import ContextIndex, chains_to_tree
from engine.proposer import Plan, Proposer, Row
from engine.spec_config import SpeculativeConfig
from models.pair import ModelPair
from sampling.proposal import DRAFT, LOOKUP, NO_PROPOSAL, Proposal
from sampling.tree import MAX_TREE_NODES

HYBRID = "hybrid"


class PromptLookupProposer:
    """The continuation of the most recent earlier occurrence of the context's longest matching
    suffix (engine/prompt_lookup.py): no weights, a point mass at each proposed token. A tree
    takes the most recent distinct continuations, one chain each. Per-request state: the
    context's n-gram index over the row's history list."""

    method = LOOKUP
    sources = (LOOKUP,)
    uses_draft = False
    match_driven = True

    def __init__(self, lookup_range: tuple[int, int], trees: bool, max_tree_nodes: int = MAX_TREE_NODES) -> None:
        self.lookup_range = lookup_range  # n-gram lengths (--prompt-lookup-min / -max)
        self.trees = trees
        self.max_tree_nodes = max_tree_nodes

    def start(self, rows: Sequence[Row], kv_needs: Sequence[int]) -> None:
        for row in rows:
            row.lookup = ContextIndex(row.history, *self.lookup_range)

    def stop(self, row: Row) -> None:
        row.lookup = None

    def plan(self, rows: Sequence[Row], caps: Sequence[int]) -> list[Plan]:
        # a row that may not draft (cap 0) was never started: no index to read
        return [
            Plan(LOOKUP, len(row.lookup.match(cap)[0]) if cap > 0 else 0) for row, cap in zip(rows, caps, strict=True)
        ]

    def propose(self, rows: Sequence[Row], plans: Sequence[Plan], depths: Sequence[int]) -> list[Proposal]:
        return [self.lookup(row, depth) if depth > 0 else NO_PROPOSAL for row, depth in zip(rows, depths, strict=True)]

    def max_nodes(self, depth: int, candidates: int) -> int:
        return min(depth * (candidates if self.trees else 1), self.max_tree_nodes)

    def lookup(self, row: Row, depth: int) -> Proposal:
        chains = row.lookup.candidates(depth, row.candidates if self.trees else 1)
        ids, parents = chains_to_tree(chains)
        return Proposal(ids[: self.max_tree_nodes], parents[: self.max_tree_nodes], None, LOOKUP)


class HybridProposer:
    """Prompt lookup where the context has a match, the draft model elsewhere; the rows of
    each source are proposed together."""

    method = HYBRID
    sources = (LOOKUP, DRAFT)
    uses_draft = True
    match_driven = False  # a row without a match still drafts, with the model

    def __init__(self, lookup: PromptLookupProposer, model: DraftModelProposer | EagleProposer) -> None:
        self.lookup, self.model = lookup, model

    @property
    def trees(self) -> bool:
        return self.model.trees

    @property
    def max_tree_nodes(self) -> int:
        return self.model.max_tree_nodes

    @max_tree_nodes.setter
    def max_tree_nodes(self, nodes: int) -> None:  # lowered to the decode peer's
        self.lookup.max_tree_nodes = self.model.max_tree_nodes = nodes

    def start(self, rows: Sequence[Row], kv_needs: Sequence[int]) -> None:
        self.lookup.start(rows, kv_needs)
        self.model.start(rows, kv_needs)

    def stop(self, row: Row) -> None:
        self.lookup.stop(row)
        self.model.stop(row)

    def plan(self, rows: Sequence[Row], caps: Sequence[int]) -> list[Plan]:
        return [
            found if found.limit else Plan(DRAFT, cap)  # either model: a forward per depth
            for found, cap in zip(self.lookup.plan(rows, caps), caps, strict=True)
        ]

    def propose(self, rows: Sequence[Row], plans: Sequence[Plan], depths: Sequence[int]) -> list[Proposal]:
        out = [NO_PROPOSAL] * len(rows)
        drafting = []
        for r, (row, plan, depth) in enumerate(zip(rows, plans, depths, strict=True)):
            if depth > 0 and plan.source == LOOKUP:
                out[r] = self.lookup.lookup(row, depth)
            elif depth > 0:
                drafting.append(r)
        if drafting:
            drafted = self.model.draft_rows([rows[r] for r in drafting], [depths[r] for r in drafting])
            for r, proposal in zip(drafting, drafted, strict=True):
                out[r] = proposal
        return out

    def max_nodes(self, depth: int, candidates: int) -> int:
        return max(self.model.max_nodes(depth, candidates), self.lookup.max_nodes(depth, candidates))


def proposer_for(pair: ModelPair, spec: SpeculativeConfig, device: str) -> Proposer:
    """A node's proposer for its config: d2t on the node's device, trees where both models mask
    by tree; a hidden-state head (a draft that ships its state) drafts for `eagle` and `hybrid`."""
    trees = pair.supports_trees
    lookup = PromptLookupProposer((spec.prompt_lookup_min, spec.prompt_lookup_max), trees, spec.max_tree_nodes)
    check_method(spec.method, pair.draft_ships)
    if spec.method == LOOKUP:
        return lookup
    if pair.draft_ships:
        model = EagleProposer(pair.draft, pair.d2t.to(device), spec.draft_law, spec.max_tree_nodes)
    else:
        model = DraftModelProposer(pair.draft, pair.d2t.to(device), spec.draft_law, trees, spec.max_tree_nodes)
    return model if spec.method == model.method else HybridProposer(lookup, model)


def check_method(method: str, head: bool) -> None:
    """`eagle` needs a hidden-state head as the draft; with a head, only `eagle` and `hybrid`
    (its KV ships with every request). ValueError naming the flag."""
    if method == EAGLE and not head:
        raise ValueError("speculative_method: 'eagle' expects --draft-model DIR with a hidden-state head (eagle.json)")
    if head and method not in (EAGLE, HYBRID):
        raise ValueError(
            f"speculative_method: the draft is a hidden-state head: expected 'eagle' or 'hybrid', got {method!r}"
        )
