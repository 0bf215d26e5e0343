"""Proposal encodings: DENSE, POINT_MASS and SPARSE (docs/design.md §3).

Defaults (`choose_encoding` with no configured encoding): a point-mass law ships
POINT_MASS (ids only), a stochastic law DENSE FP32; `compact` makes the latter SPARSE.

All three carry the exact distribution each draft token was drawn from:
* DENSE: FP32 [K, draft_vocab_size], draft-vocabulary space; a point-mass law ships
  one-hot rows;
* POINT_MASS: token ids only, p is one-hot at each token; only for point-mass laws;
* SPARSE: per row the support of p as INT32 draft ids [K, M] and FP32 probabilities
  [K, M]; rows with a smaller support are padded with probability 0.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch

from protos import pdspec_pb2
from protos.codec import encode_tensor
from sampling.filtering import point_mass
from sampling.proposal import DraftLaw

Encoding = pdspec_pb2.Proposal.Encoding


class ProposalEncoding(enum.Enum):
    DENSE = "dense"
    POINT_MASS = "point-mass"
    SPARSE = "sparse"


def choose_encoding(configured: ProposalEncoding | None, law: DraftLaw, compact: bool) -> ProposalEncoding:
    """With `compact` the smallest exact encoding for the law; else the operator's, and
    with none configured the exact default: POINT_MASS for a point mass, DENSE otherwise."""
    if law is DraftLaw.POINT_MASS and (compact or configured is None):
        return ProposalEncoding.POINT_MASS
    if compact:
        return ProposalEncoding.SPARSE
    return configured or ProposalEncoding.DENSE


def encode_proposal(
    target_token_ids: torch.Tensor,  # [K] int, the draft tokens mapped to TARGET ids
    draft_token_ids: torch.Tensor,  # [K] int, the same tokens as DRAFT ids
    draft_probs: torch.Tensor | None,  # [K, Vd] float32 the law drew from; None = point mass
    draft_vocab_size: int,
    encoding: ProposalEncoding = ProposalEncoding.DENSE,
    out: pdspec_pb2.Proposal | None = None,
    set_tensor: Callable[[str, torch.Tensor], object] | None = None,
    parents: Sequence[int] | None = None,
) -> pdspec_pb2.Proposal:
    """The Proposal message; pass `out` (e.g. `request.proposal`) to fill it in place, and
    `set_tensor(name, tensor)` to ship the tensors another way (protos.wire: as views).
    A candidate tree: the ids (and rows) are its nodes, `parents` its breadth-first layout."""
    k = int(target_token_ids.shape[0])
    proposal = pdspec_pb2.Proposal() if out is None else out
    proposal.Clear()

    def put(name: str, tensor: torch.Tensor) -> None:
        if set_tensor is None:
            encode_tensor(tensor, out=getattr(proposal, name))
        else:
            set_tensor(name, tensor)

    proposal.token_ids[:] = target_token_ids.tolist()
    if parents is not None:
        proposal.parents[:] = list(parents)
    if encoding is ProposalEncoding.POINT_MASS:
        if draft_probs is not None:
            raise ValueError("encoding: POINT_MASS is exact only for a point-mass law, got a dense distribution")
        proposal.encoding = Encoding.POINT_MASS
        return proposal
    probs = draft_probs
    if probs is None:  # point-mass law shipped densely: one-hot rows
        probs = point_mass(draft_token_ids.cpu(), draft_vocab_size)
    probs = probs.detach().float().cpu()
    if encoding is ProposalEncoding.DENSE:
        proposal.encoding = Encoding.DENSE
        put("probs", probs.reshape(k, draft_vocab_size))
        return proposal
    ids, values = sparse_support(probs)
    proposal.encoding = Encoding.SPARSE
    put("sparse_ids", ids)
    put("sparse_probs", values)
    return proposal


def sparse_support(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[K, Vd] -> (ids INT32 [K, M], probs FP32 [K, M]) of each row's nonzero entries,
    M = the largest support; padding repeats the row's first id with probability 0."""
    k = probs.shape[0]
    support = probs > 0
    width = int(support.sum(-1).max()) if k else 0
    order = torch.argsort(support.byte(), dim=-1, descending=True, stable=True)[:, :width]  # support first, by id
    values = probs.gather(1, order)
    ids = torch.where(values > 0, order, order[:, :1].expand_as(order))
    return ids.int(), values.float()
