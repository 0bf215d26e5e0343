"""Filtering, proposal laws and the target sampler."""

import pytest
import torch

from sampling import SamplingParams, SamplingTensors, propose_point_mass, propose_stochastic, sample_target
from sampling.filtering import filtered_probs
from tests.sampling.helpers import ALPHA, chi_square_pvalue

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.0]])


def rows(*params):
    return SamplingTensors.from_params(list(params))


def test_temperature_only_is_softmax():
    out = filtered_probs(LOGITS, rows(SamplingParams(do_sample=True, temperature=0.5)))
    torch.testing.assert_close(out, torch.softmax(LOGITS / 0.5, -1))


def test_top_k_keeps_k_largest_and_ties():
    out = filtered_probs(LOGITS, rows(SamplingParams(do_sample=True, top_k=2)))
    # 1.0 appears twice: the tie with the 2nd largest is kept.
    kept = torch.tensor([2.0, 1.0, 1.0]).softmax(-1)
    torch.testing.assert_close(out[0, [0, 1, 5]], kept)
    assert out[0, [2, 3, 4]].tolist() == [0, 0, 0]


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = filtered_probs(logits, rows(SamplingParams(do_sample=True, top_p=0.8)))
    # 0.5 + 0.3 reaches 0.8 (within float rounding the 3rd may be needed); check the contract:
    kept = out[0] > 0
    assert kept[0] and kept[1] and not kept[3]
    torch.testing.assert_close(out.sum(-1), torch.ones(1))
    out = filtered_probs(logits, rows(SamplingParams(do_sample=True, top_p=0.6)))
    assert (out[0] > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(out[0, :2], torch.tensor([0.625, 0.375]))


def test_top_p_zero_and_one_disable():
    for top_p in (0.0, 1.0):
        out = filtered_probs(LOGITS, rows(SamplingParams(do_sample=True, top_p=top_p)))
        torch.testing.assert_close(out, torch.softmax(LOGITS, -1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=False),
        SamplingParams(do_sample=True, temperature=0),
        SamplingParams(do_sample=True, top_k=1),
    ],
)
def test_greedy_rows_are_point_masses(params):
    assert params.is_greedy
    out = filtered_probs(LOGITS, rows(params))
    assert out.tolist() == [[1.0, 0, 0, 0, 0, 0]]


def test_mixed_rows_use_their_own_parameters():
    logits = LOGITS.expand(3, -1)
    out = filtered_probs(
        logits,
        rows(
            SamplingParams(), SamplingParams(do_sample=True, top_k=3), SamplingParams(do_sample=True, temperature=2.0)
        ),
    )
    assert out[0].tolist() == [1.0, 0, 0, 0, 0, 0]
    assert int((out[1] > 0).sum()) == 3
    torch.testing.assert_close(out[2], torch.softmax(LOGITS[0] / 2, -1))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_params(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        SamplingParams(do_sample=True, **kwargs)


def test_point_mass_law():
    sample = propose_point_mass(torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 1.0]]))
    assert sample.token_ids.tolist() == [1, 0] and sample.probs is None


def test_stochastic_law_samples_from_the_distribution_it_returns():
    n = 100_000
    params = rows(*[SamplingParams(do_sample=True, temperature=0.8, top_k=5, top_p=0.95)] * n)
    gen = torch.Generator().manual_seed(5)
    sample = propose_stochastic(LOGITS.expand(n, -1), params, torch.rand(n, generator=gen))
    assert torch.allclose(sample.probs.sum(-1), torch.ones(n))
    assert chi_square_pvalue(sample.token_ids, sample.probs[0]) > ALPHA
    assert (sample.probs[torch.arange(n), sample.token_ids] > 0).all()


def test_target_sampler_shapes_and_greedy_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 9, generator=gen)
    target = sample_target(
        logits, rows(SamplingParams(), SamplingParams(do_sample=True)), torch.rand(2, 4, generator=gen)
    )
    assert target.probs.shape == (2, 4, 9) and target.token_ids.shape == (2, 4)
    assert target.token_ids[0].tolist() == logits[0].argmax(-1).tolist()
    assert (target.probs[0].max(-1).values == 1).all()
    torch.testing.assert_close(target.probs[1], torch.softmax(logits[1], -1))


def test_target_sampler_draws_from_q():
    n = 100_000
    logits = LOGITS.expand(n, 1, -1)
    params = rows(*[SamplingParams(do_sample=True, top_p=0.9)] * n)
    target = sample_target(logits, params, torch.rand(n, 1, generator=torch.Generator().manual_seed(9)))
    assert chi_square_pvalue(target.token_ids[:, 0], target.probs[0, 0]) > ALPHA
