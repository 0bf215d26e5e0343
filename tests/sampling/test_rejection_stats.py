"""Emitted tokens follow q exactly and acceptance equals sum(min(p, q)), through every
backend (the torch reference; the CuPy kernel on a GPU); a biased sampler must fail the same
checks, so these statistics can never go blind."""

import pytest

from sampling import rejection_sample
from tests.sampling.helpers import BACKEND_DEVICE, BACKENDS, biased_rejection_sample
from tests.sampling.stat_cases import check_sampler


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_backend_is_exact(dense, backend):
    sampler = lambda *a: rejection_sample(*a, backend=backend)  # noqa: E731
    assert check_sampler(sampler, dense, seed=11, device=BACKEND_DEVICE[backend]) == []


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_biased_sampler_is_caught(dense):
    failures = check_sampler(biased_rejection_sample, dense, seed=11)
    assert any("do not follow q" in f for f in failures), failures
    assert any("acceptance" in f for f in failures), failures
