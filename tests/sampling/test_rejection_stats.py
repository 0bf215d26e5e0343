"""Emitted tokens follow q exactly and acceptance equals sum(min(p, q)); a biased
sampler must fail the same checks, so these statistics can never go blind."""

import pytest

from sampling import rejection_sample
from tests.sampling.helpers import biased_rejection_sample
from tests.sampling.stat_cases import check_sampler


def torch_sampler(*args):
    return rejection_sample(*args, backend="torch")


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_reference_is_exact(dense):
    assert check_sampler(torch_sampler, dense, seed=11) == []


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_biased_sampler_is_caught(dense):
    failures = check_sampler(biased_rejection_sample, dense, seed=11)
    assert any("do not follow q" in f for f in failures), failures
    assert any("acceptance" in f for f in failures), failures
