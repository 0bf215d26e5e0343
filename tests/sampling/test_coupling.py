"""Coupled verification of point-mass proposals (sampling/verifier.py, `positions`): the
emitted tokens follow q at every position and a draft d is accepted with probability q(d),
as under the rejection test; the per-position uniforms are uniform and depend only on the
position. A coupling that drew every position with one uniform must fail the same checks."""

from __future__ import annotations

import math

import pytest
import torch

import sampling.verifier as verifier_module
from sampling import RequestRng, SamplingParams, Verifier, VerifyBatch, stream_uniforms
from tests.sampling.helpers import ALPHA, chi_square_pvalue
from tests.sampling.stat_cases import P, Q

ROWS = 40_000
K = Q.shape[0] - 1
PARAMS = SamplingParams(do_sample=True, temperature=1.0)


def failures(monkeypatch_at=None, tree: bool = False) -> list[str]:
    """ROWS seeded rows of K point-mass drafts (the draft's argmax) verified by coupling against
    q = Q (logits log Q), each row at its own start position; the failed checks."""
    drafts = P.argmax(-1).expand(ROWS, K).contiguous()  # [N, K]
    logits = Q.log().expand(ROWS, K + 1, -1).contiguous()  # [N, K+1, V]
    rngs = [RequestRng(seed, stream="coupling") for seed in range(ROWS)]
    positions = [seed % 97 for seed in range(ROWS)]
    verifier = Verifier("torch")
    if tree:  # the chain as a tree: the tree kernel's greedy rule couples the same way
        parents = torch.arange(-1, K - 1).expand(ROWS, K)
        batch = VerifyBatch(drafts, parents=parents, num_nodes=[K] * ROWS, positions=positions)
    else:
        batch = VerifyBatch(drafts, positions=positions)
    result = verifier.verify(batch, logits, [PARAMS] * ROWS, rngs)
    out, emitted = result.output_token_ids, result.accepted_token_num
    found = []
    for i in range(K + 1):
        reached = emitted > i
        if not reached.any():
            found.append(f"position {i}: no row emits a token there")
            continue
        pvalue = chi_square_pvalue(out[reached, i].long(), Q[i])
        if pvalue < ALPHA:
            found.append(f"position {i}: emitted tokens do not follow q (chi-square p={pvalue:.2e})")
    for i, rate in enumerate(Q[:K].gather(1, P.argmax(-1, keepdim=True)).squeeze(1).tolist()):
        n = int((emitted > i).sum())
        if n == 0:
            continue
        measured = int((emitted > i + 1).sum()) / n
        sigma = math.sqrt(rate * (1 - rate) / n)
        if abs(measured - rate) > 5 * sigma:
            found.append(f"position {i}: acceptance {measured:.4f}, expected {rate:.4f} +- 5*{sigma:.4f}")
    return found


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_coupled_point_masses_keep_the_law_and_the_acceptance(tree):
    assert failures(tree=tree) == []


def test_one_uniform_for_every_position_is_caught(monkeypatch):
    def first_position_only(rngs, counts, device, width, at=None, shift=None):
        out = stream_uniforms(rngs, counts, device, width, at, shift)
        for b, start in enumerate(at or []):
            if start is not None:
                out[b, : counts[b]] = out[b, 0].item()
        return out

    monkeypatch.setattr(verifier_module, "stream_uniforms", first_position_only)
    found = failures()
    assert any("do not follow q" in f for f in found), found


def test_position_uniforms_are_uniform_and_keyed_by_position_alone():
    rng = RequestRng(5, stream="decode")
    chunk = rng.at(10, 8)
    rng.uniforms(3)  # the stream does not move them
    assert [rng.at(10 + j, 1)[0] for j in range(8)] == chunk == RequestRng(5, stream="decode").at(10, 8)
    assert RequestRng(5, stream="prefill").at(10, 8) != chunk and RequestRng(6, stream="decode").at(10, 8) != chunk
    values = torch.tensor([u for seed in range(50) for u in RequestRng(seed).at(0, 2000)])
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    bins = (values * 64).long()  # 100,000 draws in 64 equal bins
    assert chi_square_pvalue(bins, torch.full((64,), 1 / 64)) > ALPHA
    # Consecutive positions are independent: pairs of halves fall into 4 cells equally.
    pairs = (values[:-1] < 0.5).long() * 2 + (values[1:] < 0.5).long()
    assert chi_square_pvalue(pairs, torch.full((4,), 0.25)) > ALPHA


def test_a_coupled_row_needs_its_position_count():
    with pytest.raises(ValueError, match="positions: expected 2 entries, got 1"):
        Verifier("torch").verify(
            VerifyBatch(torch.zeros(2, 1, dtype=torch.int64), positions=[0]),
            torch.zeros(2, 2, 6),
            [PARAMS] * 2,
            [RequestRng(0)] * 2,
        )


def test_context_depths_of_chains_trees_and_padding():
    """The depth of each context (the root, then after each node), for every row at once:
    a chain's run 0..N, a tree's follow its parents, padding nodes (parent -1) sit at depth 1."""
    from sampling.verifier import context_depths

    parents = torch.tensor(
        [
            [-1, 0, 1, 2, 3],  # a chain of 5
            [-1, -1, 0, 1, 2],  # two roots' children, then a child of each, then a grandchild
            [-1, 0, -1, -1, -1],  # a chain of 2, then padding
        ]
    )
    assert context_depths(parents).tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 1, 1]]
    assert context_depths(torch.empty(2, 0, dtype=torch.int64)).tolist() == [[0], [0]]
