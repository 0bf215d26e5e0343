"""Statistical checks shared by the torch and the cupy tests (fixed seeds, alpha = 1e-6)."""

from __future__ import annotations

import math

import torch

from tests.sampling.helpers import ALPHA, chi_square_pvalue

ROWS = 200_000
K = 3
# Per-position target q and draft p over V = 6, chosen far apart so that a biased
# sampler is caught by a wide margin at this sample size.
Q = torch.tensor(
    [
        [0.40, 0.05, 0.20, 0.05, 0.25, 0.05],
        [0.10, 0.30, 0.10, 0.30, 0.10, 0.10],
        [0.02, 0.08, 0.60, 0.10, 0.10, 0.10],
        [0.30, 0.20, 0.10, 0.10, 0.20, 0.10],
    ]
)
P = torch.tensor(
    [
        [0.10, 0.40, 0.10, 0.30, 0.05, 0.05],
        [0.30, 0.10, 0.30, 0.10, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    ]
)


def make_batch(dense: bool, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    draft_ids = torch.multinomial(P, ROWS, replacement=True, generator=gen).T.contiguous()  # [N, K]
    if not dense:
        draft_ids = P.argmax(-1).expand(ROWS, K).contiguous()
    target_ids = torch.multinomial(Q, ROWS, replacement=True, generator=gen).T.contiguous()  # [N, K+1]
    uniforms = torch.rand(ROWS, K + 1, generator=gen)
    args = (
        draft_ids,
        P.expand(ROWS, K, -1).contiguous() if dense else None,
        Q.expand(ROWS, K + 1, -1).contiguous(),
        target_ids,
        uniforms,
        torch.ones(ROWS, dtype=torch.bool),
    )
    return tuple(a.to(device) if a is not None else None for a in args)


def expected_acceptance(dense: bool) -> torch.Tensor:
    """[K]: sum(min(p, q)) for dense drafts, q[argmax p] for point masses."""
    if dense:
        return torch.minimum(P, Q[:K]).sum(-1)
    return Q[:K].gather(1, P.argmax(-1, keepdim=True)).squeeze(1)


def check_sampler(sampler, dense: bool, seed: int, device: str = "cpu") -> list[str]:
    """Run ROWS rows through `sampler`; return a list of failed checks (empty = exact)."""
    out, emitted = sampler(*make_batch(dense, seed, device))
    out, emitted = out.cpu(), emitted.cpu()
    failures = []
    for i in range(K + 1):
        reached = emitted > i  # rows that emit a token at position i; it must follow Q[i]
        pvalue = chi_square_pvalue(out[reached, i].long(), Q[i])
        if pvalue < ALPHA:
            failures.append(f"position {i}: emitted tokens do not follow q (chi-square p={pvalue:.2e})")
    for i, rate in enumerate(expected_acceptance(dense).tolist()):
        n = int((emitted > i).sum())
        measured = int((emitted > i + 1).sum()) / n
        sigma = math.sqrt(rate * (1 - rate) / n)
        if abs(measured - rate) > 5 * sigma:
            failures.append(f"position {i}: acceptance {measured:.4f}, expected {rate:.4f} +- 5*{sigma:.4f}")
    return failures
