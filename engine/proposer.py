"""Drafting: the one implementation both nodes use, behind one interface.

A `Proposer` turns rows (a request's context, draft state, parameters and generator) and a
depth per row into `Proposal`s in TARGET space: token ids, the tree's parents, and the law
each node was drawn from (None = point mass). Three methods (`SPECULATIVE_METHODS`):
* draft: the draft model (`draft_tokens` below), its ids mapped through d2t here, once;
* prompt-lookup: the continuation of an earlier occurrence of the context's suffix
  (engine/prompt_lookup.py), no weights, a point mass;
* hybrid: prompt lookup where the context has a match, the draft model elsewhere.
`plan` says, before any drafting, which source each row would use and how deep it could
go, so the caller can pick each row's K (engine/adaptive.py) and then `propose`.

The draft model's drafting:
A request's proposal is a candidate TREE of a fixed shape (`tree_shape`: children per
node at each depth; all ones is the usual chain of K drafts). Depth by depth, every row's
frontier nodes get their children in ONE draft forward for the whole batch: depth 1 from
the logits after the last emitted token, deeper ones from the previous depth's nodes fed
as tree tokens (`extend_tree`). Siblings are drawn without replacement from the node's
law (`sampling.propose_candidates`), so each carries the exact law it was drawn from.

Each request's uniforms are drawn up front from its own generator, one per node of the
full shape in breadth-first order (for either law), so a seeded request's stream never
depends on the law, on its batch, or on candidates dropped where a law ran out of support.
Drafts read TARGET-vocabulary ids (EAGLE-style): each drafted token is mapped through d2t
(a device gather) before it is fed back, as a device tensor where the draft takes one; the
host reads every depth's ids at once, after the last draft forward.

Layout (the wire's and the verifier's): nodes in breadth-first order, siblings contiguous
in draw order; parents[n] is the parent node's index, -1 for children of the last emitted
token. The draft consumes the nodes of depths 1..K-1 (its open tree); the leaves are not fed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.transfer import to_device
from engine.options import SPECULATIVE_METHODS
from engine.prompt_lookup import ContextIndex, chains_to_tree, check_lookup_range
from models.base import CausalLM, State
from models.pair import ModelPair
from sampling import DraftToTargetMap, RequestRng, SamplingParams, SamplingTensors, point_mass, propose_candidates
from sampling.proposal import DRAFT, LOOKUP, NO_PROPOSAL, Drafted, DraftLaw, Proposal
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


def check_tree_limits(max_draft_candidates: int, max_tree_nodes: int) -> None:
    """The multi-draft flags of both nodes."""
    if max_draft_candidates < 1:
        raise ValueError(f"max_draft_candidates: expected >= 1, got {max_draft_candidates}")
    if not 1 <= max_tree_nodes <= MAX_TREE_NODES:
        raise ValueError(f"max_tree_nodes: expected 1..{MAX_TREE_NODES}, got {max_tree_nodes}")


def shape_nodes(shape: Sequence[int]) -> int:
    """Nodes of the full tree of this shape."""
    return sum(math.prod(shape[: d + 1]) for d in range(len(shape)))


@dataclass
class _Node:
    full: int  # index in the full shape's breadth-first layout (its uniform)
    value: int  # where its (draft id, target id, valid) sit in the step's drawn values
    probs: torch.Tensor | None
    parent: int  # compact index of the parent, -1 = the last emitted token


def draft_tokens(
    draft: CausalLM,
    d2t: DraftToTargetMap,
    law: DraftLaw,
    states: Sequence[State],
    feeds: Sequence[Sequence[int]],
    shapes: Sequence[Sequence[int]],
    params: SamplingTensors,
    uniforms: torch.Tensor,
) -> list[Drafted]:
    """Row r: consume feeds[r] (target ids ending with the last emitted token) into states[r],
    then draft a tree of shapes[r]. uniforms [R, max nodes] on the sampling device (row r's
    first shape_nodes(shapes[r]) are its own); params for R rows. The draft states are left
    with an open tree (the inner nodes) when a shape is deeper than 1: the caller closes it.

    The drawn ids stay on the device until the end: a draft that takes its tree tokens as a
    device tensor (`device_tokens`) is fed each depth without the host waiting for the draw,
    and the host reads every depth's ids at once. Only a stochastic law drawing several
    siblings must be read at once: it can run out of support, and the nodes it drops change
    what the next depth feeds. A single draw fed unread that found no mass (non-finite
    logits) keeps its node with a one-hot law at the id it was fed: a proposal of a known
    law, so verification stays exact."""
    device = uniforms.device
    trees: list[list[_Node]] = [[] for _ in states]
    frontier: list[list[int]] = [[-1] for _ in states]  # row r's nodes at the current depth (-1: the root)
    rows = [r for r, shape in enumerate(shapes) if len(shape)]
    if not rows:
        return [Drafted([], [], [], None) for _ in states]
    logits = draft.extend_batch([states[r] for r in rows], [feeds[r] for r in rows])
    context = {(r, -1): row[-1] for r, row in zip(rows, logits, strict=True)}  # (row, node) -> logits [Vd]
    device_fed = getattr(draft, "device_tokens", False)
    drawn: list[torch.Tensor] = []  # [3, n] (draft id, target id, valid) per draw, on the device
    count = 0  # columns of cat(drawn)
    known, read = torch.empty(3, 0, dtype=torch.int64), 0  # the host copy of cat(drawn[:read])
    depth = 0
    while rows:
        # The children of every frontier node of every row, grouped by fan-out: one draw per group.
        by_fanout: dict[int, list[tuple[int, int, int]]] = {}  # k -> (row, parent, full index of child 0)
        for r in rows:
            shape, k = shapes[r], shapes[r][depth]
            level = shape_nodes(shape[:depth])  # full index of this depth's first node
            above = shape_nodes(shape[: depth - 1]) if depth else 0
            for parent in frontier[r]:
                slot = trees[r][parent].full - above if parent >= 0 else 0  # the parent's place in its level
                by_fanout.setdefault(k, []).append((r, parent, level + slot * k))
        children: list[list[int]] = [[] for _ in states]
        for k, group in by_fanout.items():
            last = torch.stack([context[(r, parent)] for r, parent, _ in group]).to(device)  # [M, Vd]
            draws = torch.stack([uniforms[r, first : first + k] for r, _, first in group])  # [M, k]
            sample = propose_candidates(law, last, params.select([r for r, _, _ in group]), draws, k)
            mapped = d2t.map_tokens(sample.token_ids.to(d2t.d2t.device)).to(device)
            offset = count
            drawn.append(torch.stack([sample.token_ids, mapped, sample.valid.long()]).view(3, -1))  # [3, M*k]
            count += drawn[-1].shape[1]
            may_drop = law is DraftLaw.STOCHASTIC and k > 1
            if may_drop or not device_fed:
                known, read = _read(known, drawn, read)  # the host needs these values now
            for m, (r, parent, first) in enumerate(group):
                for c in range(k):
                    value = offset + m * k + c
                    if not may_drop or known[2, value]:
                        probs = None if sample.probs is None else sample.probs[m, c]
                        trees[r].append(_Node(first + c, value, probs, parent))
                        children[r].append(len(trees[r]) - 1)
        depth += 1
        rows = [r for r in rows if depth < len(shapes[r]) and children[r]]
        if not rows:
            break
        # Feed this depth's nodes as tree tokens: the next depth's contexts.
        values = [[trees[r][n].value for n in children[r]] for r in rows]
        parents = [[trees[r][n].parent for n in children[r]] for r in rows]
        if read == len(drawn):  # on the host already
            fed = draft.extend_tree([states[r] for r in rows], [known[1, v].tolist() for v in values], parents)
        else:
            order = torch.tensor([v for row in values for v in row], dtype=torch.int64)
            tokens = torch.cat(drawn, 1)[1][to_device(order, device)]  # [N] target ids, on the device
            placeholders = [[-2 - v for v in row] for row in values]  # -2 - value: set when the host reads it
            fed = draft.extend_tree([states[r] for r in rows], placeholders, parents, device_tokens=tokens)
        for r, row_logits in zip(rows, fed, strict=True):
            for n, node_logits in zip(children[r], row_logits, strict=True):
                context[(r, n)] = node_logits
            frontier[r] = children[r]
    known, _ = _read(known, drawn, read)  # the one read of the deferred draws
    ids = known.tolist()
    for tree in trees:
        for node in tree:
            if not ids[2][node.value]:  # a draw fed unread found no mass (non-finite draft logits):
                # it proposes the id it was fed, a point mass
                node.probs = point_mass(torch.tensor(ids[0][node.value], device=node.probs.device), len(node.probs))
    for state in states:  # the tree tokens fed from the device, in their values now
        _resolve(state, ids[1])
    return [_drafted(tree, ids) for tree in trees]


def _read(known: torch.Tensor, drawn: list[torch.Tensor], read: int) -> tuple[torch.Tensor, int]:
    """`known` with the draws from `read` on appended, in one device -> host copy; how many are read."""
    if read == len(drawn):
        return known, read
    return torch.cat([known, torch.cat(drawn[read:], 1).cpu()], 1), len(drawn)


def _resolve(state: State, target_ids: list[int]) -> None:
    """Replace the placeholders (-2 - value) of tree tokens fed from the device by their ids."""
    if state.tree is None:
        return
    tokens = state.tokens
    for i in range(state.tree.base, len(tokens)):
        if tokens[i] < 0:
            tokens[i] = target_ids[-2 - tokens[i]]


def _drafted(tree: list[_Node], ids: list[list[int]]) -> Drafted:
    probs = [n.probs for n in tree]
    return Drafted(
        [ids[0][n.value] for n in tree],
        [ids[1][n.value] for n in tree],
        [n.parent for n in tree],
        torch.stack(probs) if tree and probs[0] is not None else None,
    )


class Row(Protocol):
    """What a proposer reads of one request (both nodes' per-request objects provide it)."""

    history: list[int]  # prompt + every emitted token; the last one is what the proposal follows
    lookup: ContextIndex | None  # the same tokens, indexed (prompt lookup)
    draft_state: State | None  # consumed a prefix of history (the draft model)
    params: SamplingParams
    rng: RequestRng
    candidates: int  # per tree node (1: a chain)


class DraftingConfig(Protocol):
    """The drafting fields both nodes' engine configs carry."""

    speculative_method: str
    draft_law: DraftLaw
    max_tree_nodes: int
    device: str
    prompt_lookup_min: int
    prompt_lookup_max: int


@dataclass(frozen=True)
class Plan:
    source: str  # what would propose for the row
    limit: int  # the most drafts it could propose now (0: none, e.g. no prompt-lookup match)


class Proposer:
    """One speculative method over a model pair (`method` in SPECULATIVE_METHODS)."""

    def __init__(
        self,
        method: str,
        draft: CausalLM | None,
        d2t: DraftToTargetMap | None,
        law: DraftLaw,
        trees: bool,
        max_tree_nodes: int = MAX_TREE_NODES,
        lookup_range: tuple[int, int] = (2, 5),
    ) -> None:
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: expected one of {SPECULATIVE_METHODS}, got {method!r}")
        check_lookup_range(*lookup_range)
        self.method = method
        self.draft, self.d2t, self.law = draft, d2t, law
        self.trees = trees  # both models mask by tree: rows may ask for candidates
        self.max_tree_nodes = max_tree_nodes
        self.lookup_range = lookup_range  # prompt lookup's n-gram lengths (--prompt-lookup-min/-max)

    @classmethod
    def for_node(cls, pair: ModelPair, config: DraftingConfig) -> Proposer:
        """A node's proposer: d2t on the node's device, trees where both models mask by tree."""
        return cls(
            config.speculative_method,
            pair.draft,
            pair.d2t.to(config.device),
            config.draft_law,
            pair.supports_trees,
            config.max_tree_nodes,
            (config.prompt_lookup_min, config.prompt_lookup_max),
        )

    def index(self, row: Row) -> None:
        """Give a row that may use prompt lookup its context index (over its history list)."""
        if self.method != DRAFT:
            row.lookup = ContextIndex(row.history, *self.lookup_range)

    @property
    def uses_draft(self) -> bool:
        """Whether any row may need the draft model (and so a draft state)."""
        return self.method != LOOKUP

    def plan(self, rows: Sequence[Row], caps: Sequence[int]) -> list[Plan]:
        out = []
        for row, cap in zip(rows, caps, strict=True):
            if self.method == DRAFT:
                out.append(Plan(DRAFT, cap))
                continue
            matched, _ = row.lookup.match(cap)
            if matched or self.method == LOOKUP:
                out.append(Plan(LOOKUP, len(matched)))
            else:
                out.append(Plan(DRAFT, cap))  # hybrid, no match: the draft model
        return out

    def propose(self, rows: Sequence[Row], plans: Sequence[Plan], depths: Sequence[int]) -> list[Proposal]:
        """Row r's proposal of depth depths[r] (<= plans[r].limit) from plans[r].source; depth 0:
        none. The draft model's rows are drafted together, in one forward per depth."""
        out = [NO_PROPOSAL] * len(rows)
        drafting = []
        for r, (row, plan, depth) in enumerate(zip(rows, plans, depths, strict=True)):
            if depth <= 0:
                continue
            if plan.source == LOOKUP:
                out[r] = self._lookup(row, depth)
            else:
                drafting.append(r)
        if drafting:
            drafted = self._draft([rows[r] for r in drafting], [depths[r] for r in drafting])
            for r, proposal in zip(drafting, drafted, strict=True):
                out[r] = proposal
        return out

    def max_nodes(self, depth: int, candidates: int) -> int:
        """The most nodes a row's proposal of this depth can have."""
        nodes = shape_nodes(self.shape(depth, candidates)) if self.uses_draft else 0
        if self.method != DRAFT:  # prompt lookup: one chain per candidate
            nodes = max(nodes, min(depth * (candidates if self.trees else 1), self.max_tree_nodes))
        return nodes

    def shape(self, depth: int, candidates: int) -> tuple[int, ...]:
        """The tree shape the draft model draws for a row (all ones: a chain of `depth`)."""
        return tree_shape(depth, candidates if self.trees else 1, self.max_tree_nodes)

    def _lookup(self, row: Row, depth: int) -> Proposal:
        chains = row.lookup.candidates(depth, row.candidates if self.trees else 1)
        ids, parents = chains_to_tree(chains)
        return Proposal(ids[: self.max_tree_nodes], parents[: self.max_tree_nodes], None, LOOKUP)

    def _draft(self, rows: Sequence[Row], depths: Sequence[int]) -> list[Proposal]:
        shapes = [self.shape(depth, row.candidates) for row, depth in zip(rows, depths, strict=True)]
        sizes = [shape_nodes(shape) for shape in shapes]
        device = self.d2t.d2t.device
        # One uniform per node of the full shape, for either law: a seeded stream never depends on the law.
        uniforms = torch.stack(
            [
                torch.nn.functional.pad(row.rng.uniforms(n), (0, max(sizes) - n))
                for row, n in zip(rows, sizes, strict=True)
            ]
        )
        drafted = draft_tokens(
            self.draft,
            self.d2t,
            self.law,
            [row.draft_state for row in rows],
            [row.history[len(row.draft_state.tokens) :] for row in rows],  # catch up, ends with the last token
            shapes,
            SamplingTensors.from_params([row.params for row in rows], device),
            to_device(uniforms, device),  # [R, N_max], zero padded
        )
        return [self.d2t.proposal(d.target_ids, d.parents, d.probs, source=DRAFT, drafted=d) for d in drafted]
