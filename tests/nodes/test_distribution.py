"""The whole PD pipeline samples exactly from the target: the joint distribution of the first
3 tokens over 20,000 seeded requests matches the target model's exact probabilities
(chi-square, alpha = 1e-6), for K in {1, 4} and both draft laws; the same test catches a
verifier that lets equal ids bypass the ratio test. Candidate trees (2 per node, depth 2) pass
the same test (point-mass laws here; dense laws under `make test-slow`). Requests go through the real prefill
engine, serialized DecodeRequests, the validator and the batched decode engine
(tests/nodes/harness.py); the transport is covered by the gRPC tests."""

import collections

import pytest
from scipy import stats

from models.loader import load_pair
from sampling.proposal import DraftLaw
from tests.nodes.harness import exact_joint, generate_many, generate_many_verifiers
from tests.sampling.helpers import ALPHA, biased_rejection_sample

SAMPLES = 20_000
PROMPT = list(b"import ")  # varied continuations, and a draft that differs from the target


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def joint(pair):
    return exact_joint(pair, PROMPT, 3, SAMPLES)


def joint_pvalue(outputs, joint) -> float:
    """Bins: every 3-token prefix expected >= 5 times, plus one bin for all the rest."""
    counts = collections.Counter(tuple(out[:3]) for out in outputs)
    observed, expected = [], []
    for prefix, prob in joint.items():
        if prob * SAMPLES >= 5:
            observed.append(counts.get(prefix, 0))
            expected.append(prob * SAMPLES)
    observed.append(SAMPLES - sum(observed))
    expected.append(SAMPLES - sum(expected))
    assert len(observed) > 100  # enough bins for the test to have power
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("law", list(DraftLaw), ids=lambda law: law.value)
def test_joint_distribution_is_the_targets_k1(pair, joint, law):
    outputs = generate_many(pair, PROMPT, range(SAMPLES), k=1, law=law, max_new_tokens=3)
    assert all(len(out) == 3 for out in outputs)
    assert joint_pvalue(outputs, joint) > ALPHA


@pytest.mark.parametrize("law", list(DraftLaw), ids=lambda law: law.value)
def test_joint_distribution_is_the_targets_k4_and_a_biased_verifier_is_caught(pair, joint, law):
    """The same 20,000 prefilled requests verified by the real sampler and by the biased one."""
    real, biased = generate_many_verifiers(
        pair, PROMPT, range(SAMPLES), k=4, law=law, max_new_tokens=3, samplers=[None, biased_rejection_sample]
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
    """Top-k candidates (one-hot laws) in 2-candidate trees of depth 2."""
    outputs = generate_many(pair, PROMPT, range(SAMPLES), k=2, law=DraftLaw.POINT_MASS, max_new_tokens=3, candidates=2)
    assert joint_pvalue(outputs, joint) > ALPHA
