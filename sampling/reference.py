"""Vectorized PyTorch reference of rejection sampling (docs/design.md §2): the oracle.

Terms, used the same way everywhere in pdspec:
* accepted  - a draft token that passed its test and is emitted as is;
* recovered - the token emitted at the first rejection (residual sample on stochastic
              rows, the target token on greedy rows);
* bonus     - the target sampler's token at position K, emitted when all K drafts
              are accepted.
Inputs (`ChainInputs`, sampling/batch.py) are assumed validated (`sampling.checks`); no Python
loop over rows.
"""

from __future__ import annotations

import torch

from sampling.batch import ChainInputs
from sampling.categorical import inverse_cdf_sample, rows_per_slice


def rejection_sample_torch(inputs: ChainInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return emit_tokens(acceptance_mask(inputs), inputs)


def acceptance_mask(inputs: ChainInputs) -> torch.Tensor:
    """[B, K] bool: whether each draft passes its own test (ignoring earlier rejections)."""
    draft_token_ids, draft_probs, target_probs = inputs.draft_token_ids, inputs.draft_probs, inputs.target_probs
    k = draft_token_ids.shape[1]
    draft = draft_token_ids.long()[..., None]  # [B, K, 1]
    q = target_probs[:, :k].gather(-1, draft).squeeze(-1)  # [B, K]
    p = torch.ones_like(q) if draft_probs is None else draft_probs.gather(-1, draft).squeeze(-1)
    stochastic = inputs.uniform_samples[:, :k] * p < q  # float32, equal ids do not bypass it
    greedy = inputs.target_token_ids[:, :k].long() == draft_token_ids.long()
    return torch.where(inputs.do_sample[:, None], stochastic, greedy)


def emit_tokens(accepted: torch.Tensor, inputs: ChainInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted [B, K] bool -> the accepted prefix, then one recovered or bonus token, then -1 padding."""
    batch, k = inputs.draft_token_ids.shape
    device = inputs.target_probs.device
    num_accepted = accepted.int().cumprod(-1).sum(-1).long()  # [B] drafts before the first rejection
    out = torch.full((batch, k + 1), -1, dtype=torch.int32, device=device)
    positions = torch.arange(k, device=device)
    out[:, :k] = torch.where(positions < num_accepted[:, None], inputs.draft_token_ids.int(), -1)
    final = inputs.target_token_ids.long().gather(1, num_accepted[:, None]).squeeze(1)  # bonus or greedy recovery
    residual_rows = torch.nonzero(inputs.do_sample & (num_accepted < k)).squeeze(1)  # [R]
    if residual_rows.numel() > 0:
        final[residual_rows] = _recovered_tokens(residual_rows, num_accepted[residual_rows], inputs)
    out.scatter_(1, num_accepted[:, None], final[:, None].int())
    return out, (num_accepted + 1).int()


def _recovered_tokens(
    rows: torch.Tensor,  # [R] rows whose first rejection is stochastic
    position: torch.Tensor,  # [R] the rejected position
    inputs: ChainInputs,
) -> torch.Tensor:
    """[R] int64 residual samples from relu(q - p), uniform = the NEXT one."""
    step = rows_per_slice(inputs.target_probs.shape[-1], inputs.target_probs.device)  # bounded temporaries
    return torch.cat(
        [_recover_slice(rows[s : s + step], position[s : s + step], inputs) for s in range(0, len(rows), step)]
    )


def _recover_slice(rows: torch.Tensor, position: torch.Tensor, inputs: ChainInputs) -> torch.Tensor:
    q = inputs.target_probs[rows, position]  # [R, V]
    if inputs.draft_probs is None:
        residual = q.clone()
        residual[torch.arange(len(rows), device=q.device), inputs.draft_token_ids[rows, position].long()] = 0
    else:
        residual = torch.relu(q - inputs.draft_probs[rows, position])  # float32
    index, has_mass = inverse_cdf_sample(residual, inputs.uniform_samples[rows, position + 1])
    return torch.where(has_mass, index, inputs.target_token_ids[rows, position].long())
