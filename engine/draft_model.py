"""The draft model's drafting (`DraftModelProposer`): a trained draft, a layer-skip draft of
the target, or the built-in n-gram pair's draft.

A request's proposal is a candidate TREE of a fixed shape (`tree_shape`: children per node at
each depth; all ones is the usual chain of K drafts). Depth by depth, every row's frontier
nodes get their children in ONE draft forward for the whole batch: depth 1 from the logits
after the last emitted token, deeper ones from the previous depth's nodes fed as tree tokens
(`extend_tree`). Siblings are drawn without replacement from the node's law
(`sampling.propose_candidates`), so each carries the exact law it was drawn from.

Each request's uniforms are drawn up front from its own generator, one per node of the full
shape in breadth-first order (for either law), so a seeded request's stream never depends on
the law, on its batch, or on candidates dropped where a law ran out of support. Drafts read
TARGET-vocabulary ids (EAGLE-style): each drafted token is mapped through d2t (a device gather)
before it is fed back, as a device tensor where the draft takes one; the host reads every
depth's ids at once, after the last draft forward. The draft consumes the nodes of depths
1..K-1 (its open tree); the leaves are not fed.

Per-request state: a draft state over the row's history (`start`), caught up with the tokens
emitted since before each draft, its KV reserved for all the request may need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.transfer import to_device
from engine.grammar import GrammarState
from engine.proposer import Plan, Row, shape_nodes, tree_shape
from models.base import CausalLM, State
from sampling import DraftToTargetMap, SamplingTensors, point_mass, propose_candidates, stream_uniforms
from sampling.proposal import DRAFT, NO_PROPOSAL, Drafted, DraftLaw, Proposal
from sampling.tree import MAX_TREE_NODES


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
    grammars: Sequence[GrammarState | None] = (),
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
    law, so verification stays exact.

    grammars[r] (structured outputs): row r drafts under its grammar — each context's draft
    logits are -inf where the grammar forbids the id's target token after the node's path, so
    the law drawn from, and shipped, is the masked one (fewer drafts the verifier must reject).
    Such rows are read each depth: the next depth's masks need the drawn ids."""
    device = uniforms.device
    trees: list[list[_Node]] = [[] for _ in states]
    frontier: list[list[int]] = [[-1] for _ in states]  # row r's nodes at the current depth (-1: the root)
    rows = [r for r, shape in enumerate(shapes) if len(shape)]
    if not rows:
        return [Drafted([], [], [], None) for _ in states]
    logits = draft.extend_batch([states[r] for r in rows], [feeds[r] for r in rows])
    context = {(r, -1): row[-1] for r, row in zip(rows, logits, strict=True)}  # (row, node) -> logits [Vd]
    device_fed = getattr(draft, "device_tokens", False)
    guided = any(g is not None for g in grammars)
    d2t_host = d2t.d2t.cpu() if guided else None
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
            if guided:
                last = _under_grammar(last, group, grammars, trees, known, d2t_host)
            draws = torch.stack([uniforms[r, first : first + k] for r, _, first in group])  # [M, k]
            sample = propose_candidates(law, last, params.select([r for r, _, _ in group]), draws, k)
            mapped = d2t.map_tokens(sample.token_ids.to(d2t.d2t.device)).to(device)
            offset = count
            drawn.append(torch.stack([sample.token_ids, mapped, sample.valid.long()]).view(3, -1))  # [3, M*k]
            count += drawn[-1].shape[1]
            may_drop = law is DraftLaw.STOCHASTIC and k > 1
            if may_drop or not device_fed or guided:
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


def _under_grammar(
    last: torch.Tensor,  # [M, Vd] the group's draft logits
    group: list[tuple[int, int, int]],  # (row, parent node, full index of its first child)
    grammars: Sequence[GrammarState | None],
    trees: list[list[_Node]],
    known: torch.Tensor,  # [3, read] the drawn (draft id, target id, valid) on the host
    d2t: torch.Tensor,  # [Vd] target id of each draft id, on the host
) -> torch.Tensor:
    """The group's logits with each constrained row's draft ids its grammar forbids after the
    parent's path set to -inf (a context with no allowed draft id stays as it is)."""
    out = last
    for m, (r, parent, _) in enumerate(group):
        if grammars[r] is None:
            continue
        path = []
        while parent >= 0:  # the target ids from the root to the parent
            path.append(int(known[1, trees[r][parent].value]))
            parent = trees[r][parent].parent
        allowed = grammars[r].draft_mask(path[::-1], d2t)
        if allowed is not None:
            out = out.clone() if out is last else out
            out[m] = out[m].masked_fill(~allowed.to(out.device), float("-inf"))
    return out


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


class DraftModelProposer:
    """Proposals from a draft model, in the law `law`, its ids mapped to the target's by `d2t`."""

    method = DRAFT
    sources = (DRAFT,)
    uses_draft = True
    match_driven = False

    def __init__(
        self,
        draft: CausalLM,
        d2t: DraftToTargetMap,
        law: DraftLaw,
        trees: bool,
        max_tree_nodes: int = MAX_TREE_NODES,
    ) -> None:
        self.draft, self.d2t, self.law = draft, d2t, law
        self.trees = trees  # both models mask by tree: rows may ask for candidates
        self.max_tree_nodes = max_tree_nodes

    def start(self, rows: Sequence[Row], kv_needs: Sequence[int]) -> None:
        """A draft state over each row's history but its last token (which the first draft feeds),
        its KV reserved for kv_needs[r] positions: one draft forward for the batch."""
        draft = self.draft
        for row, need in zip(rows, kv_needs, strict=True):
            row.draft_state = draft.empty_state()
            draft.reserve(row.draft_state, need)
        if rows:
            draft.extend_last([row.draft_state for row in rows], [row.history[:-1] for row in rows])

    def stop(self, row: Row) -> None:
        if row.draft_state is not None:
            self.draft.release(row.draft_state)
            row.draft_state = None

    def plan(self, rows: Sequence[Row], caps: Sequence[int]) -> list[Plan]:
        return [Plan(DRAFT, cap) for cap in caps]

    def propose(self, rows: Sequence[Row], plans: Sequence[Plan], depths: Sequence[int]) -> list[Proposal]:
        out = [NO_PROPOSAL] * len(rows)
        drafting = [r for r, depth in enumerate(depths) if depth > 0]
        if drafting:
            drafted = self.draft_rows([rows[r] for r in drafting], [depths[r] for r in drafting])
            for r, proposal in zip(drafting, drafted, strict=True):
                out[r] = proposal
        return out

    def max_nodes(self, depth: int, candidates: int) -> int:
        return shape_nodes(self.shape(depth, candidates))

    def shape(self, depth: int, candidates: int) -> tuple[int, ...]:
        """The tree shape drawn for a row (all ones: a chain of `depth`)."""
        return tree_shape(depth, candidates if self.trees else 1, self.max_tree_nodes)

    def draft_rows(self, rows: Sequence[Row], depths: Sequence[int]) -> list[Proposal]:
        """Every row drafted to its depth (> 0), in one draft forward per depth."""
        shapes = [self.shape(depth, row.candidates) for row, depth in zip(rows, depths, strict=True)]
        sizes = [shape_nodes(shape) for shape in shapes]
        device = self.d2t.d2t.device
        # One uniform per node of the full shape, for either law: a seeded stream never depends on the law.
        uniforms = stream_uniforms([row.rng for row in rows], sizes, device)  # [R, N_max], zero padded
        drafted = draft_tokens(
            self.draft,
            self.d2t,
            self.law,
            [row.draft_state for row in rows],
            [row.history[len(row.draft_state.tokens) :] for row in rows],  # catch up, ends with the last token
            shapes,
            SamplingTensors.from_params([row.params for row in rows], device),
            uniforms,
            [row.grammar for row in rows],
        )
        return self.d2t.proposals(drafted)
