"""Tree verification is exact: emitted tokens follow q at every depth, for k in {1, 2, 4}
siblings, shared and unshared prefixes, stochastic and point-mass drafts, through every backend
(the torch reference; the CuPy kernel on a GPU); and deliberately
biased verifiers fail the same checks, so these statistics can never go blind."""

import pytest

from sampling import DraftLaw, tree_rejection_sample
from sampling import tree as tree_module
from tests.sampling.helpers import BACKEND_DEVICE, BACKENDS
from tests.sampling.tree_stats import check_tree_sampler

SHAPES = [(1,), (2,), (4,), (1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1)]
LAWS = [DraftLaw.STOCHASTIC, DraftLaw.POINT_MASS]


def torch_sampler(*args):
    return tree_rejection_sample(*args, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("law", LAWS, ids=lambda law: law.value)
@pytest.mark.parametrize("branching", SHAPES, ids=str)
def test_tree_verification_is_exact(branching, law, backend):
    """Every backend (on a GPU, the CuPy kernel's rows also run its grid-stride loop past 65535 blocks)."""
    sampler = lambda *a: tree_rejection_sample(*a, backend=backend)  # noqa: E731
    seed = len(branching) * 10 + branching[0]
    assert check_tree_sampler(sampler, branching, law, seed=seed, device=BACKEND_DEVICE[backend]) == []


@pytest.mark.parametrize("branching", [(2,), (4, 1, 1), (2, 2, 1)], ids=str)
def test_with_replacement_laws_are_caught(branching):
    """Siblings drawn without replacement but verified as if each had the law p."""
    failures = check_tree_sampler(torch_sampler, branching, DraftLaw.STOCHASTIC, seed=5, with_replacement=True)
    assert any("do not follow q" in f for f in failures), failures


@pytest.mark.parametrize("law", LAWS, ids=lambda law: law.value)
@pytest.mark.parametrize("branching", [(4,), (4, 1, 1)], ids=str)
def test_unnormalised_residual_is_caught(branching, law, monkeypatch):
    """Z kept at 1 after a rejection: later siblings are tested against W instead of W / Z."""
    monkeypatch.setattr(tree_module, "_residual_mass", lambda residual: residual.new_ones(len(residual)))
    failures = check_tree_sampler(torch_sampler, branching, law, seed=6)
    assert any("do not follow q" in f for f in failures), failures
