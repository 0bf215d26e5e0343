"""Exact speculative decoding on a transformer: the joint distribution of the first 2 tokens
over 20,000 seeded requests (make test: point-mass drafts, 5,000 requests: POINT_MASS_SAMPLES;
the rest under make test-slow)
through the real prefill and decode engines (serialized DecodeRequests, the validator, the
batched decode engine: tests/nodes/harness.py) matches the
probabilities a tiny random Llama (pdspec's own modules, fp32) assigns at temperature 1, for
both draft laws with K = 2 and a layer-skip draft (its first layer); the same test catches a
verifier that lets equal ids bypass the ratio test.

Token 1 is the prefill node's sample; token 2 is the decode node's verdict on the prefill's
first proposal (accepted draft or residual sample), computed on the KV the prefill exported.
Bins: all V^2 pairs with their exact probabilities, the smallest pooled until each bin
expects >= 5 (tests/sampling/helpers.chi_square_pvalue); alpha = 1e-6."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.loader import load_pair
from sampling.proposal import DraftLaw
from tests.models.hf_fixtures import make_family_checkpoint
from tests.nodes.harness import generate_many, generate_many_verifiers, target_probs
from tests.sampling.helpers import ALPHA, biased_rejection_sample, chi_square_pvalue

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

SAMPLES = 20_000
# Point-mass drafts in make test: 5,000 requests (20,000 under make test-slow). Power: the biased
# verifier accepts every point-mass draft (the greedy rule) whatever the target drew; measured
# at 2,500 requests its p-value underflows to 0.0 (< 1e-308) and the chi-square's
# noncentrality grows linearly with the sample, so at 5,000 it is caught with p < 1e-308 far
# below alpha; the real verifier: p = 0.73 / 0.87 / 0.28 / 0.26 at 2,500 / 5,000 / 10,000 /
# 20,000. The stochastic law stays at 20,000: its biased verifier (equal ids bypass the ratio)
# gives p = 9e-11 at 20,000 but only 1.5e-3 at 10,000.
POINT_MASS_SAMPLES = 5_000
VOCAB = 24
K = 2
PROMPT = [3, 7, 11, 2, 5]


def sharp_init(model) -> None:
    """N(0, 1) embeddings, N(0, 0.35) head (logit std ~2 over 24 ids), N(0, 0.2) attention / MLP
    weights (instead of transformers' 0.02, so attention mixes); norms left at 1."""
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.normal_(0, 1.0 if "embed" in name else 0.35 if "lm_head" in name else 0.2)


def make_sharp_llama(directory, *, seed: int = 5):
    """A 2-layer random Llama whose next-token law is neither flat nor near-deterministic and
    depends on the context (sharp_init), with no stop token: every request runs its 2 tokens."""
    return make_family_checkpoint(
        directory,
        seed=seed,
        vocab_size=VOCAB,
        hidden=32,
        max_position_embeddings=64,
        eos_token_id=None,
        init=sharp_init,
        words=[f"w{i}" for i in range(VOCAB - 2)],
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 32-wide model is all per-op overhead: a second intra-op thread only adds wake-ups
    (and on a shared 2-core machine, several times the runtime)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(target_model=make_sharp_llama(tmp_path_factory.mktemp("sharp-llama")), draft_layers=1)


@pytest.fixture(scope="module")
def joint(pair) -> np.ndarray:
    """[V, V] float64: P(t1, t2) = q(t1 | prompt) q(t2 | prompt, t1), from the model's logits."""
    first = target_probs(pair, PROMPT)
    return np.stack([first[t] * target_probs(pair, [*PROMPT, t]) for t in range(VOCAB)])


def two_token_outputs(pair, law: DraftLaw, samplers, samples: int = SAMPLES, **kwargs) -> list[list[list[int]]]:
    """The first 2 tokens of `samples` seeded K = 2 requests, once per verifier in `samplers`
    (None = the real one), through the memoized harness; `kwargs` go to the harness (device,
    backend, candidates)."""
    return generate_many_verifiers(
        pair, PROMPT, range(samples), k=K, law=law, max_new_tokens=2, samplers=samplers, memoize=True, **kwargs
    )


def joint_pvalue(outs: list[list[int]], joint: np.ndarray) -> float:
    assert all(len(out) == 2 for out in outs)
    cells = torch.tensor([out[0] * VOCAB + out[1] for out in outs])
    return chi_square_pvalue(cells, torch.from_numpy(joint.ravel()))


def test_the_model_gives_the_test_power(pair, joint):
    """Not flat, not deterministic, token 2 depends on token 1, the draft disagrees with the
    target often enough that both acceptance and residual sampling are exercised."""
    assert joint.sum() == pytest.approx(1.0, abs=1e-9)
    first = joint.sum(1)
    assert 0.15 < first.max() < 0.6 and (first >= 0.01).sum() >= 8
    assert (joint * SAMPLES >= 5).sum() >= 100  # bins before pooling
    top = np.argsort(first)[::-1][:4]
    conditionals = [joint[t] / first[t] for t in top]
    tv = [0.5 * np.abs(a - b).sum() for i, a in enumerate(conditionals) for b in conditionals[i + 1 :]]
    assert min(tv) > 0.2, tv  # P(t2 | t1) differs across the likely t1
    overlaps = []
    for t in top:
        logits, _ = pair.draft.prefill([*PROMPT, t])
        draft = torch.softmax(logits.double(), -1).numpy()
        overlaps.append(np.minimum(draft, joint[t] / first[t]).sum())  # stochastic-law acceptance rate
    assert min(overlaps) > 0.4 and max(overlaps) < 0.9, overlaps


def test_memoized_harness_is_exact(pair):
    """The memoized models change no output: same tokens as the plain pair, token for token."""
    for law in DraftLaw:
        plain = generate_many(pair, PROMPT, range(100), k=K, law=law, max_new_tokens=4)
        memo = generate_many(pair, PROMPT, range(100), k=K, law=law, max_new_tokens=4, memoize=True)
        assert plain == memo and all(len(out) == 4 for out in plain)


@pytest.mark.parametrize(
    ("law", "samples"),
    [
        # 20,000 requests (its biased verifier is caught only from there): make test-slow, and on a
        # GPU make gpu-check (tests/engine/test_gpu_distribution.py); make test keeps the stochastic
        # law's exactness through both engines on the n-gram pair (tests/nodes/test_distribution.py)
        pytest.param(DraftLaw.STOCHASTIC, SAMPLES, id="stochastic", marks=pytest.mark.slow),
        pytest.param(DraftLaw.POINT_MASS, POINT_MASS_SAMPLES, id="point-mass"),
        pytest.param(DraftLaw.POINT_MASS, SAMPLES, id="point-mass-20000", marks=pytest.mark.slow),
    ],
)
def test_joint_distribution_is_the_transformers_and_a_biased_verifier_is_caught(pair, joint, law, samples):
    """The same prefilled requests verified by the real sampler and by the biased one (one
    test, so that no two workers compute the same outputs)."""
    real, biased = two_token_outputs(pair, law, [None, biased_rejection_sample], samples)
    real_p, biased_p = joint_pvalue(real, joint), joint_pvalue(biased, joint)
    print(f"{law.value}, {samples}: real verifier p = {real_p:.3g}, biased verifier p = {biased_p:.3g}")
    assert real_p > ALPHA
    assert biased_p < ALPHA
