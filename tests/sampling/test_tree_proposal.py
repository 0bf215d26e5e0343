"""propose_candidates: k = 1 is `propose`, candidates are drawn without replacement with
their exact laws, greedy rows and point masses take the top k."""

import pytest
import torch

from sampling import DraftLaw, SamplingParams, SamplingTensors, propose, propose_candidates
from sampling.filtering import filtered_probs
from tests.sampling.helpers import ALPHA, chi_square_pvalue

MIXED = [
    SamplingParams(do_sample=True),
    SamplingParams(do_sample=True, temperature=0.7, top_k=3),
    SamplingParams(do_sample=True, top_p=0.8),
    SamplingParams(),  # greedy
    SamplingParams(do_sample=True, top_k=1),  # greedy
]


def mixed_rows(repeats: int) -> SamplingTensors:
    return SamplingTensors.from_params(MIXED * repeats)


@pytest.mark.parametrize("law", list(DraftLaw), ids=lambda law: law.value)
def test_one_candidate_is_propose(law):
    rows = len(MIXED) * 40
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, 50, generator=gen).round(decimals=1)  # ties among the largest logits
    uniforms = torch.rand(rows, 1, generator=gen)
    params = mixed_rows(40)
    got = propose_candidates(law, logits, params, uniforms, 1)
    want = propose(law, logits, params, uniforms[:, 0])
    assert torch.equal(got.token_ids[:, 0], want.token_ids)
    assert (got.probs is None) == (want.probs is None)
    if want.probs is not None:
        assert torch.equal(got.probs[:, 0], want.probs)
    assert got.valid.all()


def test_candidates_are_distinct_with_their_conditional_laws():
    rows, vocab, k = len(MIXED) * 20, 30, 4
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=gen)
    params = mixed_rows(20)
    got = propose_candidates(DraftLaw.STOCHASTIC, logits, params, torch.rand(rows, k, generator=gen), k)
    p = filtered_probs(logits, params)
    sampled = ~params.greedy
    for i in range(k):
        weights = p.scatter(1, got.token_ids[:, :i], 0.0)  # p without the earlier candidates
        law = p if i == 0 else weights / weights.sum(-1, keepdim=True)  # candidate 0: p as filtered
        mass = weights.sum(-1) > 0
        assert torch.equal(got.valid[sampled, i], mass[sampled])
        ok = sampled & mass
        assert torch.equal(got.probs[ok, i], law[ok])
        assert (got.probs[sampled & ~mass, i] == 0).all()
        assert (weights[ok].gather(1, got.token_ids[ok, i : i + 1]) > 0).all()  # drawn from its law's support
    assert (got.valid[1::5].sum(1) == 3).all()  # top_k = 3 leaves 3 of the k = 4 candidates
    valid_ids = [set(r[v].tolist()) for r, v in zip(got.token_ids, got.valid, strict=True)]
    assert all(len(s) == int(v.sum()) for s, v in zip(valid_ids, got.valid, strict=True))  # distinct


def test_pairs_follow_the_without_replacement_law():
    rows, probs = 100_000, torch.tensor([0.4, 0.3, 0.2, 0.1])
    params = SamplingTensors.from_params([SamplingParams(do_sample=True)]).repeat_rows(rows)
    gen = torch.Generator().manual_seed(2)
    got = propose_candidates(
        DraftLaw.STOCHASTIC, probs.log().expand(rows, -1), params, torch.rand(rows, 2, generator=gen), 2
    )
    expected = probs[:, None] * probs[None, :] / (1 - probs[:, None])  # P(x1, x2), x2 != x1
    expected.fill_diagonal_(0)
    assert chi_square_pvalue(got.token_ids[:, 0] * 4 + got.token_ids[:, 1], expected.reshape(-1)) > ALPHA


@pytest.mark.parametrize("law", list(DraftLaw), ids=lambda law: law.value)
def test_greedy_rows_and_point_masses_take_the_top_k_lower_id_first(law):
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    params = SamplingTensors.from_params([SamplingParams(), SamplingParams()])
    got = propose_candidates(law, logits, params, torch.rand(2, 3), 3)
    assert got.token_ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert got.valid.all()
    if law is DraftLaw.STOCHASTIC:
        assert torch.equal(got.probs, torch.nn.functional.one_hot(got.token_ids, 5).float())
    else:
        assert got.probs is None


def test_bad_arguments():
    params = SamplingTensors.from_params([SamplingParams(do_sample=True)] * 2)
    logits = torch.randn(2, 6)
    for k in (0, 7):
        with pytest.raises(ValueError, match=rf"^k: expected 1 <= k <= Vd = 6, got {k}"):
            propose_candidates(DraftLaw.STOCHASTIC, logits, params, torch.rand(2, 3), k)
    with pytest.raises(ValueError, match=r"^uniforms: expected shape \[2, 3\], got \[2, 2\]"):
        propose_candidates(DraftLaw.STOCHASTIC, logits, params, torch.rand(2, 2), 3)
