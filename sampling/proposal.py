"""Proposal laws: how a draft model turns logits into a draft token AND the exact
normalized distribution it drew that token from (draft-vocabulary space).

* point mass (top-1): argmax; the distribution is a point mass, returned as None so
  callers skip all dense work (docs/design.md §2: draft_probs=None).
* stochastic: temperature / top-k / top-p per row; the distribution is the filtered,
  renormalized float32 distribution the token was sampled from. Greedy rows (§2 rule)
  get a one-hot row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sampling.categorical import inverse_cdf_sample
from sampling.filtering import filtered_probs
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
    token_ids, _ = inverse_cdf_sample(probs, uniforms)
    return DraftSample(token_ids, probs)


def propose(law: DraftLaw, logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor) -> DraftSample:
    if law is DraftLaw.POINT_MASS:
        return propose_point_mass(logits)
    return propose_stochastic(logits, params, uniforms)
