"""The whole PD pipeline samples exactly from the target: the joint distribution of the first
3 tokens over 20,000 seeded requests (5,000 for point-mass drafts in make test, 20,000 under
make test-slow: POINT_MASS_SAMPLES) matches the target model's exact probabilities
(chi-square, alpha = 1e-6), for K in {1, 4} and both draft laws; the same test catches a
verifier that lets equal ids bypass the ratio test (K = 4; and K = 1 at the reduced size).
Candidate trees (2 per node, depth 2) pass the same test (point-mass laws here; dense laws
under `make test-slow`). Requests go through the real prefill engine, serialized
DecodeRequests, the validator and the batched decode engine (tests/nodes/harness.py); the
transport is covered by the gRPC tests."""

import collections

import pytest
from scipy import stats

from models.loader import load_pair
from sampling.proposal import DraftLaw
from tests.nodes.harness import exact_joint, generate_many, generate_many_verifiers
from tests.sampling.helpers import ALPHA, biased_rejection_sample

SAMPLES = 20_000
# Point-mass drafts: 5,000 requests in make test. Power: the biased verifier accepts every
# point-mass draft (the greedy rule) whatever the target drew; at K = 4 its p-value underflows
# to 0.0 (< 1e-308) already at 2,500 requests, and the chi-square's noncentrality grows
# linearly with the sample; each reduced test runs the biased verifier on its own requests and
# asserts it is caught. The real verifier at K = 4: p = 0.50 / 0.82 / 0.83 / 0.32 at 2,500 /
# 5,000 / 10,000 / 20,000, with 202 bins at 5,000 (516 at 20,000). The stochastic law stays at
# 20,000: its biased verifier gives p = 7e-14 at 20,000, 9e-8 at 10,000 and 0.17 at 5,000.
POINT_MASS_SAMPLES = 5_000
LAWS = [
    pytest.param(DraftLaw.STOCHASTIC, SAMPLES, id="stochastic"),
    pytest.param(DraftLaw.POINT_MASS, POINT_MASS_SAMPLES, id="point-mass"),
    pytest.param(DraftLaw.POINT_MASS, SAMPLES, id="point-mass-20000", marks=pytest.mark.slow),
]
PROMPT = list(b"import ")  # varied continuations, and a draft that differs from the target


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def joint(pair):
    return exact_joint(pair, PROMPT, 3, SAMPLES)


def joint_pvalue(outputs, joint) -> float:
    """Bins: every 3-token prefix expected >= 5 times among the len(outputs) samples, plus one
    bin for all the rest (`joint` holds every prefix expected >= 0.5 times among SAMPLES)."""
    n = len(outputs)
    assert n <= SAMPLES
    counts = collections.Counter(tuple(out[:3]) for out in outputs)
    observed, expected = [], []
    for prefix, prob in joint.items():
        if prob * n >= 5:
            observed.append(counts.get(prefix, 0))
            expected.append(prob * n)
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    assert len(observed) > 100  # enough bins for the test to have power
    return float(stats.chisquare(observed, expected).pvalue)


# K = 1 with dense laws: `make test-slow` (the K = 4 test below runs the same law and the same
# verifier, and shows its power against the biased verifier, in every run).
@pytest.mark.parametrize(
    ("law", "samples"),
    [pytest.param(*p.values, id=p.id, marks=pytest.mark.slow) if p.id == "stochastic" else p for p in LAWS],
)
def test_joint_distribution_is_the_targets_k1(pair, joint, law, samples):
    """At the reduced size (point-mass drafts) the same prefilled requests are also verified by
    the biased sampler, which must be caught: the test shows its power at the size it runs."""
    reduced = samples < SAMPLES
    samplers = [None, biased_rejection_sample] if reduced else [None]
    real, *biased = generate_many_verifiers(
        pair, PROMPT, range(samples), k=1, law=law, max_new_tokens=3, samplers=samplers
    )
    assert all(len(out) == 3 for out in real)
    assert joint_pvalue(real, joint) > ALPHA
    assert len(biased) == reduced and all(joint_pvalue(outputs, joint) < ALPHA for outputs in biased)


@pytest.mark.parametrize(("law", "samples"), LAWS)
def test_joint_distribution_is_the_targets_k4_and_a_biased_verifier_is_caught(pair, joint, law, samples):
    """The same prefilled requests verified by the real sampler and by the biased one."""
    real, biased = generate_many_verifiers(
        pair, PROMPT, range(samples), k=4, law=law, max_new_tokens=3, samplers=[None, biased_rejection_sample]
    )
    assert all(len(out) == 3 for out in real)
    assert joint_pvalue(real, joint) > ALPHA
    assert joint_pvalue(biased, joint) < ALPHA


@pytest.mark.slow
def test_stochastic_candidate_trees_keep_the_targets_distribution(pair, joint):
    """Multi-draft with dense laws: 2 candidates per node, depth 2 (6-node trees) at both
    nodes. `make test-slow` (about 4 minutes on 2 cores); a biased tree verifier is caught by
    tests/sampling/test_tree_stats.py at 1e5 samples."""
    outputs = generate_many(pair, PROMPT, range(SAMPLES), k=2, law=DraftLaw.STOCHASTIC, max_new_tokens=3, candidates=2)
    assert all(len(out) == 3 for out in outputs)
    assert joint_pvalue(outputs, joint) > ALPHA


def test_point_mass_candidate_trees_keep_the_targets_distribution(pair, joint):
    """Top-k candidates (one-hot laws) in 2-candidate trees of depth 2, over POINT_MASS_SAMPLES x
    2 requests (the power of the tree verifier's own tests: tests/sampling/test_tree_stats.py)."""
    outputs = generate_many(
        pair, PROMPT, range(2 * POINT_MASS_SAMPLES), k=2, law=DraftLaw.POINT_MASS, max_new_tokens=3, candidates=2
    )
    assert joint_pvalue(outputs, joint) > ALPHA
