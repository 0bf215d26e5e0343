"""Proposal laws: how a draft model turns logits into a draft token AND the exact
normalized distribution it drew that token from (draft-vocabulary space).

* point mass (top-1): argmax; the distribution is a point mass, returned as None so
  callers skip all dense work (docs/design.md §2: draft_probs=None).
* stochastic: temperature / top-k / top-p per row; the distribution is the filtered,
  renormalized float32 distribution the token was sampled from. Greedy rows (§2 rule)
  get a one-hot row.

`propose_candidates` draws k siblings of a draft tree (sampling/tree.py) at once, without
replacement, each with its exact law given the earlier ones.

What the verifier reads of one request's step is a `Proposal`, in TARGET space whatever made it
(the draft model, prompt lookup, the prefill node): token ids, the tree's parents, and the law
each node was drawn from (None = point mass). The draft model's own draw, in draft space, rides
along as `Drafted` (what the DENSE and SPARSE encodings ship); `DraftToTargetMap.proposal`
(sampling/d2t.py) is the one place a draw in draft space becomes a `Proposal`.

Layout: nodes in breadth-first order, siblings contiguous in draw order; parents[n] is the
parent node's index, -1 for children of the last emitted token. A chain of K drafts has
parents -1, 0, ..., K-2.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sampling.categorical import draw
from sampling.filtering import filtered_probs, point_mass
from sampling.params import SamplingTensors


class DraftLaw(enum.Enum):
    POINT_MASS = "point-mass"
    STOCHASTIC = "stochastic"


@dataclass(frozen=True)
class DraftSample:
    token_ids: torch.Tensor  # [B] int64, draft-vocab ids
    probs: torch.Tensor | None  # [B, Vd] float32, or None = point mass at token_ids


def propose_point_mass(logits: torch.Tensor) -> DraftSample:
    """logits [B, Vd] -> argmax ids, point mass."""
    return DraftSample(logits.argmax(-1), None)


def propose_stochastic(logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor) -> DraftSample:
    """logits [B, Vd]; uniforms [B] float32 in [0, 1) -> sampled ids and their law."""
    probs = filtered_probs(logits, params)  # [B, Vd]
    token_ids, _ = draw(probs, uniforms)
    return DraftSample(token_ids, probs)


def propose(law: DraftLaw, logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor) -> DraftSample:
    if law is DraftLaw.POINT_MASS:
        return propose_point_mass(logits)
    return propose_stochastic(logits, params, uniforms)


@dataclass(frozen=True)
class CandidateSample:
    token_ids: torch.Tensor  # [M, k] int64 draft-vocab ids
    probs: torch.Tensor | None  # [M, k, Vd] float32 law of each candidate given the earlier ones; None = point mass
    valid: torch.Tensor  # [M, k] bool: False where the law has no mass left (support smaller than k)


def propose_candidates(
    law: DraftLaw, logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor, k: int
) -> CandidateSample:
    """k distinct candidates per row, drawn without replacement, with their exact laws.

    logits [M, Vd] (any float dtype); params for M rows; uniforms [M, k] float32 in
    [0, 1) (unused by the point-mass law); 1 <= k <= Vd. Stochastic law: candidate i is
    drawn by `inverse_cdf_sample` from p = filtered_probs(logits, params) with candidates
    0..i-1 zeroed, and its law is those weights over their sum (candidate 0: p itself,
    so k = 1 is exactly `propose`). Greedy rows and the point-mass law: the top-k ids
    (ties: lower id first, as argmax), each with a one-hot law. Where `valid` is False
    the id is meaningless and its law is all zero.
    """
    rows, vocab = logits.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k: expected 1 <= k <= Vd = {vocab}, got {k}")
    if law is DraftLaw.POINT_MASS:
        top = _top_ids(logits, k)
        return CandidateSample(top, None, torch.ones_like(top, dtype=torch.bool))
    if tuple(uniforms.shape) != (rows, k):
        raise ValueError(f"uniforms: expected shape {[rows, k]}, got {list(uniforms.shape)}")
    weights = filtered_probs(logits, params)  # [M, Vd] p, then p with the drawn candidates zeroed
    ids, laws, valid = [], [], []
    for i in range(k):
        token, has_mass = draw(weights, uniforms[:, i])
        if i == 0:
            laws.append(weights)  # normalised by construction: no division, so k = 1 equals `propose`
        else:
            total = weights.sum(-1, keepdim=True)
            laws.append(torch.where(has_mass[:, None], weights / total, 0.0))
        ids.append(token)
        valid.append(has_mass)
        weights = weights.scatter(1, token[:, None], 0.0)
    token_ids = torch.stack(ids, 1)  # [M, k]
    probs = torch.stack(laws, 1)  # [M, k, Vd]
    valid = torch.stack(valid, 1)
    if params.any_greedy:
        greedy = params.greedy[:, None]
        top = _top_ids(logits, k)
        token_ids = torch.where(greedy, top, token_ids)
        probs = torch.where(greedy[..., None], point_mass(top, probs.shape[-1]), probs)
        valid = valid | greedy
    return CandidateSample(token_ids, probs, valid)


def _top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[M, Vd] -> [M, k] int64 ids of the k largest logits, lower id first among equals
    (argmax's rule too, and one pass over Vd where a sort is several)."""
    if k == 1:
        return logits.argmax(-1, keepdim=True)
    return logits.sort(dim=-1, descending=True, stable=True).indices[:, :k]


DRAFT, LOOKUP = "draft", "prompt-lookup"  # a proposal's source
PROPOSAL_SOURCES = (DRAFT, LOOKUP)
PREFILL = "prefill"  # the source of the proposal a decode node receives: the prefill node's


@dataclass(frozen=True)
class Drafted:
    """The draft model's draw of one request's tree, in DRAFT space (breadth-first, siblings in
    draw order): what the DENSE and SPARSE encodings ship."""

    draft_ids: list[int]  # [N] DRAFT-vocabulary ids
    target_ids: list[int]  # [N] the same tokens as TARGET ids (d2t)
    parents: list[int]  # [N] parent node, -1 = the last emitted token
    probs: torch.Tensor | None  # [N, Vd] float32, the law each was drawn from; None = point mass


@dataclass(frozen=True)
class Proposal:
    """One row's proposal in TARGET space, whatever made it: what the verifier reads."""

    token_ids: list[int]  # [N] target ids, breadth-first, siblings in draw order
    parents: list[int]  # [N] parent node, -1 = the last emitted token
    probs: torch.Tensor | None  # [N, Vt] the law each node was drawn from; None = point mass
    source: str = DRAFT  # DRAFT, LOOKUP or PREFILL
    drafted: Drafted | None = None  # the draft model's draw in draft space (what DENSE / SPARSE ship)

    @property
    def is_chain(self) -> bool:
        return all(p == n - 1 for n, p in enumerate(self.parents))

    @property
    def depth(self) -> int:
        levels: list[int] = []
        for parent in self.parents:
            levels.append(1 if parent < 0 else levels[parent] + 1)
        return max(levels, default=0)

    def rank(self, node: int) -> int:
        """The node's place among its siblings (0 = drawn first)."""
        return node - self.parents.index(self.parents[node])


NO_PROPOSAL = Proposal([], [], None)
