"""Statistical checks of tree verification, shared by the torch and the cupy tests (alpha = 1e-6).

A toy language over V = 5 tokens: the target q(.|path) and the draft's logits are fixed
random functions of the token path (tables indexed by the path's code). Each row builds a
draft tree with `propose_candidates` level by level (`branching[d]` candidates under
every node of depth d), verifies it, and completes its emitted tokens to DEPTH tokens by
sampling q directly, as the next decode step would. If verification is exact, the first
d tokens follow the target's joint law q(x1) q(x2|x1) ... for every d: chi-square on
V**d cells per d.
"""

from __future__ import annotations

import math

import torch

from sampling import DraftLaw, SamplingTensors, propose_candidates
from sampling.categorical import inverse_cdf_sample
from tests.sampling.helpers import ALPHA, chi_square_pvalue

V = 5
DEPTH = 3  # joint laws of the first 1..DEPTH emitted tokens are checked
BASE = V + 1  # code(path + [x]) = code(path) * BASE + x + 1, code([]) = 0
ROWS = 100_000
_gen = torch.Generator().manual_seed(2024)
# Contexts of up to DEPTH tokens (a node at depth 3 needs q after its path). q is fairly
# peaked and the draft independent of it, so siblings are rejected often and a biased
# verifier shows at this sample size by a wide margin.
Q = torch.softmax(1.5 * torch.randn(BASE**DEPTH, V, generator=_gen), -1)  # [codes, V]
DRAFT_LOGITS = 1.5 * torch.randn(BASE**DEPTH, V, generator=_gen)  # [codes, V]


def joint_law(depth: int) -> torch.Tensor:
    """[V**depth] float64: q(x1) q(x2|x1) ... over sequences in lexicographic order."""
    probs = torch.ones(1, dtype=torch.float64)
    codes = torch.zeros(1, dtype=torch.int64)
    for _ in range(depth):
        probs = (probs[:, None] * Q[codes].double()).reshape(-1)
        codes = (codes[:, None] * BASE + torch.arange(V) + 1).reshape(-1)
    return probs


def draft_params(rows: int) -> SamplingTensors:
    """Plain sampling (temperature 1, no filter) for every row: the draft law is softmax(logits)."""
    return SamplingTensors(
        greedy=torch.zeros(rows, dtype=torch.bool),
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
    )


def build_trees(branching: tuple[int, ...], law: DraftLaw, seed: int, *, with_replacement: bool = False):
    """tree_rejection_sample arguments for ROWS trees of shape `branching`, breadth first.

    `with_replacement` hands the verifier the WRONG sibling laws: p itself for every
    sibling instead of p without the earlier siblings (a deliberately biased variant).
    """
    gen = torch.Generator().manual_seed(seed)
    level_codes = torch.zeros(ROWS, 1, dtype=torch.int64)  # [ROWS, width] path codes of a level's nodes
    level_nodes = torch.full((ROWS, 1), -1)  # their node indices (-1 = the root)
    ids, parents, probs, codes = [], [], [], []
    for k in branching:
        width = level_codes.shape[1]
        logits = DRAFT_LOGITS[level_codes.reshape(-1)]  # [ROWS * width, V]
        uniforms = torch.rand(ROWS * width, k, generator=gen)
        sample = propose_candidates(law, logits, draft_params(ROWS * width), uniforms, k)
        assert bool(sample.valid.all())  # full support: k <= V candidates always exist
        tokens = sample.token_ids.reshape(ROWS, width * k)  # children of node j are j*k .. j*k+k-1
        ids.append(tokens)
        parents.append(level_nodes.repeat_interleave(k, 1))
        if sample.probs is not None:
            laws = sample.probs[:, :1].expand(-1, k, -1) if with_replacement else sample.probs
            probs.append(laws.reshape(ROWS, width * k, V))
        level_codes = level_codes.repeat_interleave(k, 1) * BASE + tokens + 1
        codes.append(level_codes)
        first = 1 + int(level_nodes.max())
        level_nodes = torch.arange(first, first + width * k).expand(ROWS, -1)
    n_nodes = sum(t.shape[1] for t in ids)
    position_codes = torch.cat([torch.zeros(ROWS, 1, dtype=torch.int64), *codes], 1)  # [ROWS, N+1]
    target_probs = Q[position_codes]  # [ROWS, N+1, V]
    target_ids, _ = inverse_cdf_sample(target_probs.view(-1, V), torch.rand(ROWS * (n_nodes + 1), generator=gen))
    return (
        torch.cat(ids, 1),
        torch.cat(parents, 1),
        None,
        torch.cat(probs, 1) if probs else None,
        target_probs,
        target_ids.view(ROWS, n_nodes + 1),
        torch.rand(ROWS, n_nodes, generator=gen),
        torch.rand(ROWS, n_nodes + 1, generator=gen),
        torch.ones(ROWS, dtype=torch.bool),
    )


def completed_tokens(result, seed: int) -> torch.Tensor:
    """[ROWS, DEPTH] int64: each row's emitted tokens, continued by sampling q where it stopped."""
    gen = torch.Generator().manual_seed(seed + 1)
    emitted = torch.nn.functional.pad(result.output_token_ids.cpu().long(), (0, DEPTH))  # short trees: DEPTH columns
    counts = result.accepted_token_num.cpu().long()
    code = torch.zeros(ROWS, dtype=torch.int64)
    tokens = []
    for j in range(DEPTH):
        drawn, _ = inverse_cdf_sample(Q[code], torch.rand(ROWS, generator=gen))
        token = torch.where(counts > j, emitted[:, j], drawn)
        tokens.append(token)
        code = code * BASE + token + 1
    return torch.stack(tokens, 1)


def expected_first_acceptance(law: DraftLaw) -> float:
    """P(the root's only child is accepted): sum(min(p, q)), or q[argmax p] for a point mass."""
    p, q = torch.softmax(DRAFT_LOGITS[0], -1), Q[0]
    return float(torch.minimum(p, q).sum() if law is DraftLaw.STOCHASTIC else q[p.argmax()])


def check_tree_sampler(
    sampler, branching: tuple[int, ...], law: DraftLaw, seed: int, *, device: str = "cpu", with_replacement=False
) -> list[str]:
    """Run ROWS trees through `sampler`; return the failed checks (empty = exact)."""
    args = build_trees(branching, law, seed, with_replacement=with_replacement)
    result = sampler(*(a.to(device) if a is not None else None for a in args))
    tokens = completed_tokens(result, seed)
    failures = []
    for depth in range(1, DEPTH + 1):
        cells = (tokens[:, :depth] * V ** torch.arange(depth - 1, -1, -1)).sum(1)  # lexicographic code
        pvalue = chi_square_pvalue(cells, joint_law(depth))
        if pvalue < ALPHA:
            failures.append(f"first {depth} tokens: do not follow q (chi-square p={pvalue:.2e})")
    if branching[0] == 1:
        rate = expected_first_acceptance(law)
        measured = float((result.accepted_token_num.cpu() > 1).double().mean())
        sigma = math.sqrt(rate * (1 - rate) / ROWS)
        if abs(measured - rate) > 5 * sigma:
            failures.append(f"depth 1: acceptance {measured:.4f}, expected {rate:.4f} +- 5*{sigma:.4f}")
    return failures
