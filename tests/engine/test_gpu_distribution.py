"""The transformer exactness test on a GPU (`make test-gpu`): a tiny random Llama on CUDA,
sampling and rejection sampling on the device (the CuPy kernel), 20,000 seeded requests;
the joint law of the first 2 tokens matches the model's own probabilities (chi-square,
alpha 1e-6) for both draft laws and for candidate trees (the CuPy tree kernel), and the
biased verifier is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from models.loader import load_pair
from sampling.proposal import DraftLaw
from tests.nodes.harness import target_probs
from tests.nodes.test_transformer_distribution import PROMPT, VOCAB, joint_pvalue, make_sharp_llama, two_token_outputs
from tests.sampling.helpers import ALPHA, biased_rejection_sample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = make_sharp_llama(tmp_path_factory.mktemp("sharp-llama-gpu"))
    return load_pair(target_model=path, draft_layers=1, device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def joint(pair) -> np.ndarray:
    first = target_probs(pair, PROMPT)
    return np.stack([first[t] * target_probs(pair, [*PROMPT, t]) for t in range(VOCAB)])


@pytest.mark.parametrize("law", list(DraftLaw), ids=lambda law: law.value)
def test_joint_distribution_on_the_gpu_and_the_biased_verifier(pair, joint, law):
    real, biased = two_token_outputs(pair, law, [None, biased_rejection_sample], device="cuda", backend="cupy")
    real_p, biased_p = joint_pvalue(real, joint), joint_pvalue(biased, joint)
    print(f"{law.value}: real p = {real_p:.3g}, biased p = {biased_p:.3g}")
    assert real_p > ALPHA and biased_p < ALPHA


def test_candidate_trees_on_the_gpu(pair, joint):
    """Two candidates per node (the CuPy tree kernel): still the target's joint law."""
    (real,) = two_token_outputs(pair, DraftLaw.STOCHASTIC, [None], device="cuda", backend="cupy", candidates=2)
    p = joint_pvalue(real, joint)
    print(f"trees: p = {p:.3g}")
    assert p > ALPHA
