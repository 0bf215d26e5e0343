"""Exact speculative decoding with a hidden-state head: the joint law of the first 3 tokens of
seeded K = 2 requests at temperature 1 through the real prefill and decode engines (serialized
DecodeRequests, the validator, the batched decode engine: tests/nodes/harness.py) is the tiny
random Llama's own. Token 1 is the prefill node's sample; token 2 the decode node's verdict on the
head's first proposal, drafted on the prefill node from the prompt's features; token 3 comes
from the decode node's own head (caught up from the verify pass's features) where token 2 was a
correction. The same requests verified by the biased sampler must be caught.

Sizes: point-mass drafts 1,200 requests in make test (the biased verifier's p-value underflows
to 0.0 at 1,200 and 2,000; the real one's was 0.65 and 0.17); the stochastic law at 20,000 under
make test-slow (its biased verifier: p = 2e-4 at 2,000, 4e-25 at 20,000; the real one 0.69;
point masses at 20,000: 0.095). Bins: every 3-token prefix expected >= 5
times plus one for the rest; alpha = 1e-6."""

from __future__ import annotations

import collections

import pytest
from scipy import stats

from models.loader import load_pair
from sampling.proposal import DraftLaw
from tests.models.eagle_fixtures import make_head_dir, make_target, one_thread  # noqa: F401 (autouse)
from tests.nodes.harness import exact_joint, generate_many_verifiers
from tests.sampling.helpers import ALPHA, biased_rejection_sample

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

SAMPLES = 20_000
TOKENS = 3
PROMPT = [3, 7, 11, 2, 5]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-law")
    target = make_target(root / "target", layers=2)
    return load_pair(target_model=target, draft_model=make_head_dir(target, root / "head", scale=0.5))


@pytest.fixture(scope="module")
def joint(pair):
    return exact_joint(pair, PROMPT, TOKENS, SAMPLES)


def joint_pvalue(outputs, joint) -> tuple[int, float]:
    n = len(outputs)
    counts = collections.Counter(tuple(out[:TOKENS]) for out in outputs)
    observed, expected = [], []
    for prefix, prob in joint.items():
        if prob * n >= 5:
            observed.append(counts.get(prefix, 0))
            expected.append(prob * n)
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    return len(observed), float(stats.chisquare(observed, expected).pvalue)


@pytest.mark.parametrize(
    ("law", "samples"),
    [
        pytest.param(DraftLaw.POINT_MASS, 1_200, id="point-mass"),
        pytest.param(DraftLaw.POINT_MASS, SAMPLES, id="point-mass-20000", marks=pytest.mark.slow),
        pytest.param(DraftLaw.STOCHASTIC, SAMPLES, id="stochastic", marks=pytest.mark.slow),
    ],
)
def test_joint_law_is_the_targets_and_a_biased_verifier_is_caught(pair, joint, law, samples):
    real, biased = generate_many_verifiers(
        pair,
        PROMPT,
        range(samples),
        k=2,
        law=law,
        max_new_tokens=TOKENS,
        samplers=[None, biased_rejection_sample],
        method="eagle",
    )
    assert all(len(out) == TOKENS for out in real)
    bins, real_p = joint_pvalue(real, joint)
    _, biased_p = joint_pvalue(biased, joint)
    print(f"{law.value}, {samples}: {bins} bins, real verifier p = {real_p:.3g}, biased verifier p = {biased_p:.3g}")
    assert bins > 20  # enough bins for the test to have power
    assert real_p > ALPHA
    assert biased_p < ALPHA
