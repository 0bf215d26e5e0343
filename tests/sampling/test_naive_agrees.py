"""The vectorized reference equals an independent row-by-row reading of §2."""

import pytest
import torch

from sampling import rejection_sample
from sampling.naive import rejection_sample_loop
from tests.sampling.helpers import random_inputs


@pytest.mark.parametrize("vocab", [3, 5, 111, 4097])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("dense", [True, False])
def test_reference_equals_loop(vocab, k, dense):
    args = random_inputs(24, k, vocab, seed=vocab * 10 + k, dense=dense, sharpness=1.0)
    ref = rejection_sample(*args, backend="torch")
    loop = rejection_sample_loop(*args)
    assert torch.equal(ref[0], loop[0]) and torch.equal(ref[1], loop[1])
