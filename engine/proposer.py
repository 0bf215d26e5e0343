"""Drafting: the interface every speculative method implements, and what they share.

A `Proposer` turns rows (a request's context, per-request drafting state, parameters and
generator) and a depth per row into `Proposal`s in TARGET space: token ids, the tree's
parents, and the law each node was drawn from (None = point mass). One class per method
(`SPECULATIVE_METHODS`), each owning its per-request state (`start` / `stop`):
* `engine/draft_model.DraftModelProposer`: a draft model (a trained draft, a layer-skip draft
  of the target, the built-in n-gram pair's), its ids mapped through d2t;
* `engine/prompt_lookup.PromptLookupProposer`: the continuation of an earlier occurrence of
  the context's suffix, no weights, a point mass;
* `engine/eagle.EagleProposer`: a hidden-state head reading the target's features (chains);
* `engine/proposers.HybridProposer`: prompt lookup where the context has a match, the draft
  model (or the head) elsewhere.
`engine/proposers.proposer_for` builds a node's from its `SpeculativeConfig`. A benchmark or
test proposer (an oracle at a known acceptance rate) is its own class behind the same protocol.

`plan` says, before any drafting, which source each row would use and how deep it could go,
so the scheduler's policy (engine/spec_policy.py) can pick each row's K and then `propose`.

Layout (the wire's and the verifier's): nodes in breadth-first order, siblings contiguous in
draw order; parents[n] is the parent node's index, -1 for children of the last emitted token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.grammar import GrammarState
from engine.prompt_lookup import ContextIndex
from models.base import State
from sampling import Proposal, RequestRng, SamplingParams
from sampling.tree import MAX_TREE_NODES


def tree_shape(depth: int, candidates: int, max_nodes: int = MAX_TREE_NODES) -> tuple[int, ...]:
    """Children per node at each of `depth` levels: `candidates` at every level while the tree,
    completed by single chains below, stays within `max_nodes`; 1 after that.
    (4, 1) -> (4, 1): 8 nodes; depth 4 with 2 candidates -> (2, 2, 2, 2): 30 nodes."""
    shape: list[int] = []
    width, nodes = 1, 0
    for level in range(depth):
        remaining = depth - level - 1
        fanout = candidates if nodes + width * candidates * (1 + remaining) <= max_nodes else 1
        shape.append(fanout)
        width *= fanout
        nodes += width
    return tuple(shape)


def shape_nodes(shape: Sequence[int]) -> int:
    """Nodes of the full tree of this shape."""
    return sum(math.prod(shape[: d + 1]) for d in range(len(shape)))


class Row(Protocol):
    """What a proposer reads of one request (both nodes' per-request objects provide it)."""

    history: list[int]  # prompt + every emitted token; the last one is what the proposal follows
    lookup: ContextIndex | None  # the same tokens, indexed (prompt lookup)
    draft_state: State | None  # consumed a prefix of history (the draft model)
    target_state: State | None  # the target's (a hidden-state head reads the features it holds)
    params: SamplingParams
    rng: RequestRng
    candidates: int  # per tree node (1: a chain)
    grammar: GrammarState | None  # structured outputs: drafts are drawn under it (engine/grammar.py)


@dataclass(frozen=True)
class Plan:
    source: str  # what would propose for the row
    limit: int  # the most drafts it could propose now (0: none, e.g. no prompt-lookup match)


class Proposer(Protocol):
    """One speculative method. Per-request state (a match index, draft KV) lives on the row,
    made by `start` and freed by `stop`; nothing else of the engine touches it."""

    method: str  # SPECULATIVE_METHODS, or a benchmark's or test's own name (statistics, metrics)
    trees: bool  # rows may ask for candidate trees (every model involved masks by tree)
    max_tree_nodes: int  # nodes of one proposal at most (a prefill node lowers it to its peer's)
    uses_draft: bool  # rows hold draft-model KV: the scheduler reserves it with the target's
    # A row drafts only where its context matches (prompt lookup): a row without a match runs as
    # a K = 0 row, and its drafts are point masses that cost no forward (the batch gate may hold them).
    match_driven: bool
    sources: tuple[str, ...]  # the sources its plans may name (DRAFT, LOOKUP)

    def start(self, rows: Sequence[Row], kv_needs: Sequence[int]) -> None:
        """Give rows that will draft their per-request state (kv_needs[r]: KV positions row r
        may ever occupy, reserved now for a draft model's state)."""

    def stop(self, row: Row) -> None:
        """Free what `start` gave the row (a no-op for a row never started)."""

    def plan(self, rows: Sequence[Row], caps: Sequence[int]) -> list[Plan]:
        """Which source would propose for each row now, and how deep it could go (<= caps[r])."""

    def propose(self, rows: Sequence[Row], plans: Sequence[Plan], depths: Sequence[int]) -> list[Proposal]:
        """Row r's proposal of depth depths[r] (<= plans[r].limit) from plans[r].source; depth 0: none."""

    def max_nodes(self, depth: int, candidates: int) -> int:
        """The most nodes a row's proposal of this depth can have."""
