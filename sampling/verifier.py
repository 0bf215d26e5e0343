"""One speculative verification step over a batch with mixed sampling parameters.

Glues the target sampler, the per-request RNG and the rejection sampler; the caller maps
draft distributions to target space first (`DraftToTargetMap.map_probs`).
Per row and step the request's generator yields 2*(K+1) uniforms in a fixed order:
K+1 for the target sampler, then K+1 for rejection sampling, so a seeded request gets
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sampling.params import SamplingParams, SamplingTensors
from sampling.rejection import Backend, RejectionSampler
from sampling.rng import RequestRng, batch_uniforms
from sampling.target_sampler import sample_target


@dataclass(frozen=True)
class StepStats:
    """Per-row counts for metrics. accepted_tokens counts accepted DRAFT tokens only."""

    do_sample: torch.Tensor  # [B] bool, effective mode (False on greedy rows)
    draft_tokens: torch.Tensor  # [B] int64, K for every row
    accepted_tokens: torch.Tensor  # [B] int64, 0..K
    accepted_per_position: torch.Tensor  # [B, K] bool


@dataclass(frozen=True)
class VerifyResult:
    output_token_ids: torch.Tensor  # [B, K+1] int32, -1 after the last emitted token
    accepted_token_num: torch.Tensor  # [B] int32, emitted tokens per row (1..K+1)
    stats: StepStats

    def emitted_rows(self) -> list[list[int]]:
        """Every row's emitted tokens, in order: one host transfer for the whole batch."""
        tokens = self.output_token_ids.cpu().tolist()
        counts = self.accepted_token_num.cpu().tolist()
        return [row[:n] for row, n in zip(tokens, counts, strict=True)]

    def emitted(self, row: int) -> list[int]:
        """The tokens row `row` emits this step, in order."""
        return self.output_token_ids[row, : int(self.accepted_token_num[row])].tolist()


class Verifier:
    """Verifies K drafts per row against the target's K+1 logit rows."""

    def __init__(
        self,
        backend: Backend = "auto",
        device: torch.device | str = "cpu",
        sampler: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        self.device = torch.device(device)
        # `sampler` replaces the rejection sampler (the tests plug in a deliberately biased one).
        self.sampler = sampler or RejectionSampler(backend, self.device)

    def verify(
        self,
        draft_token_ids: torch.Tensor,  # [B, K] int, TARGET-vocab ids
        draft_probs: torch.Tensor | None,  # [B, K, Vt] float32 in TARGET space, None = point mass
        target_logits: torch.Tensor,  # [B, K+1, Vt]
        params: Sequence[SamplingParams],
        rngs: Sequence[RequestRng],
    ) -> VerifyResult:
        batch, k = draft_token_ids.shape
        if len(params) != batch or len(rngs) != batch:
            raise ValueError(f"params/rngs: expected {batch} entries each, got {len(params)} and {len(rngs)}")
        rows = SamplingTensors.from_params(params, self.device)
        uniforms = batch_uniforms(rngs, 2 * (k + 1), self.device)  # [B, 2(K+1)]
        target = sample_target(target_logits, rows, uniforms[:, : k + 1])
        output, emitted = self.sampler(
            draft_token_ids.to(self.device),
            None if draft_probs is None else draft_probs.to(self.device),
            target.probs,
            target.token_ids,
            uniforms[:, k + 1 :].contiguous(),
            rows.do_sample,
        )
        accepted = emitted.long() - 1
        stats = StepStats(
            do_sample=rows.do_sample,
            draft_tokens=torch.full((batch,), k, dtype=torch.int64, device=self.device),
            accepted_tokens=accepted,
            accepted_per_position=torch.arange(k, device=self.device) < accepted[:, None],
        )
        return VerifyResult(output, emitted, stats)
