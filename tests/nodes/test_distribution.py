"""The whole PD pipeline samples exactly from the target: the joint distribution of the first
3 tokens over 20,000 seeded requests matches the target model's exact probabilities
(chi-square, alpha = 1e-6), for K in {1, 4} and both draft laws; the same test catches a
verifier that lets equal ids bypass the ratio test. Requests go through the real prefill
engine, serialized DecodeRequests, the validator and the batched decode engine
(tests/nodes/harness.py); the transport is covered by the gRPC tests."""

import collections

import pytest
from scipy import stats

from models.loader import load_pair
from sampling.proposal import DraftLaw
from tests.nodes.harness import exact_joint, generate_many
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
@pytest.mark.parametrize("k", [1, 4])
def test_joint_distribution_is_the_targets(pair, joint, k, law):
    outputs = generate_many(pair, PROMPT, range(SAMPLES), k=k, law=law, max_new_tokens=3)
    assert all(len(out) == 3 for out in outputs)
    assert joint_pvalue(outputs, joint) > ALPHA


@pytest.mark.parametrize("law", list(DraftLaw), ids=lambda law: law.value)
def test_biased_verifier_is_caught(pair, joint, law):
    outputs = generate_many(
        pair, PROMPT, range(SAMPLES), k=4, law=law, max_new_tokens=3, sampler=biased_rejection_sample
    )
    assert joint_pvalue(outputs, joint) < ALPHA
