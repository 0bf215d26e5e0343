"""Target sampler: verify-pass logits -> q and the target tokens drawn from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sampling.categorical import draw
from sampling.filtering import filtered_probs
from sampling.params import SamplingTensors


@dataclass(frozen=True)
class TargetSample:
    probs: torch.Tensor  # [B, K+1, V] float32: q, renormalized after filtering
    token_ids: torch.Tensor  # [B, K+1] int64: drawn from q (argmax on greedy rows)


def sample_target(logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor) -> TargetSample:
    """logits [B, K+1, V]; params for B rows; uniforms [B, K+1] float32 in [0, 1)."""
    batch, positions, vocab = logits.shape
    rows = params.repeat_rows(positions)
    probs = filtered_probs(logits.reshape(batch * positions, vocab), rows)  # [B*(K+1), V]
    # Greedy rows hold a point mass at the argmax, so a draw from them is the argmax: with
    # only such rows, the argmax of q is the draw without its cumulative sums over V.
    if params.all_greedy:
        token_ids = probs.argmax(-1)
    else:
        token_ids, _ = draw(probs, uniforms.reshape(-1))  # rows sum to 1: always has mass
    return TargetSample(probs.view(batch, positions, vocab), token_ids.view(batch, positions))
