"""Drafting: the one implementation both nodes use.

K tokens per request from the draft model, batched over requests (one draft forward per
draft position for every row still drafting), in the node's draft law, with each
request's K uniforms drawn up front from its own generator (for either law, so a seeded
request's stream never depends on the law or on its batch). Drafts read TARGET-vocabulary
ids (EAGLE-style), so each drafted token is mapped through d2t (a device gather) before it
is fed back; the host sees the drafted ids once per draft position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.base import CausalLM, State
from sampling import DraftToTargetMap, SamplingTensors, propose
from sampling.proposal import DraftLaw


@dataclass(frozen=True)
class Drafted:
    """One request's K drafts."""

    draft_ids: list[int]  # DRAFT-vocabulary ids
    target_ids: list[int]  # the same tokens as TARGET ids (d2t)
    probs: torch.Tensor | None  # [K, Vd] float32, the law each was drawn from; None = point mass


def draft_tokens(
    draft: CausalLM,
    d2t: DraftToTargetMap,
    law: DraftLaw,
    states: Sequence[State],
    feeds: Sequence[Sequence[int]],
    ks: Sequence[int],
    params: SamplingTensors,
    uniforms: torch.Tensor,
) -> list[Drafted]:
    """Row r: consume feeds[r] (target ids ending with the last emitted token) into states[r],
    then draft ks[r] tokens. uniforms [R, max K] on the sampling device; params for R rows."""
    device = uniforms.device
    feeds = [list(f) for f in feeds]
    draft_ids: list[list[int]] = [[] for _ in states]
    target_ids: list[list[int]] = [[] for _ in states]
    probs: list[list[torch.Tensor]] = [[] for _ in states]
    for step in range(max(ks, default=0)):
        rows = [r for r, k in enumerate(ks) if step < k]
        logits = draft.extend_batch([states[r] for r in rows], [feeds[r] for r in rows])
        last = torch.stack([row[-1] for row in logits]).to(device)  # [R, Vd]
        sample = propose(law, last, params.select(rows), uniforms[rows, step])
        mapped = d2t.map_tokens(sample.token_ids.to(d2t.d2t.device)).to(device)
        drawn, mapped = torch.stack([sample.token_ids, mapped]).cpu().tolist()  # one host transfer per position
        for j, r in enumerate(rows):
            draft_ids[r].append(drawn[j])
            target_ids[r].append(mapped[j])
            feeds[r] = [mapped[j]]
            if sample.probs is not None:
                probs[r].append(sample.probs[j])
    return [
        Drafted(draft_ids[r], target_ids[r], torch.stack(probs[r]) if probs[r] else None) for r in range(len(states))
    ]
