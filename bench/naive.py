"""The simplest correct rejection sampler: a Python loop over rows and positions.

It is the baseline the vectorized reference is measured against on the CPU, and a
second, independent reading of docs/design.md §2 that the tests compare with.
"""

from __future__ import annotations

import torch


def rejection_sample_loop(draft_token_ids, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample):
    batch, k = draft_token_ids.shape
    out = torch.full((batch, k + 1), -1, dtype=torch.int32)
    emitted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        for i in range(k + 1):
            if i == k:
                out[b, i] = target_token_ids[b, k]
                emitted[b] = k + 1
                break
            d = int(draft_token_ids[b, i])
            if bool(do_sample[b]):
                p = 1.0 if draft_probs is None else draft_probs[b, i, d]
                accepted = bool(uniform_samples[b, i] * p < target_probs[b, i, d])
            else:
                accepted = int(target_token_ids[b, i]) == d
            if accepted:
                out[b, i] = d
                continue
            out[b, i] = _recover(b, i, d, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample)
            emitted[b] = i + 1
            break
    return out, emitted


def _recover(b, i, d, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample):
    if not bool(do_sample[b]):
        return int(target_token_ids[b, i])
    q = target_probs[b, i]
    if draft_probs is None:
        residual = q.clone()
        residual[d] = 0
    else:
        residual = torch.relu(q - draft_probs[b, i])
    cdf = residual.double().cumsum(0)
    total = float(cdf[-1])
    if total == 0:
        return int(target_token_ids[b, i])
    threshold = float(uniform_samples[b, i + 1]) * total
    hits = torch.nonzero((residual > 0) & (cdf > threshold))
    if len(hits):
        return int(hits[0])
    return int(torch.nonzero(residual > 0)[-1])
