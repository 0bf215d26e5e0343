import math

import pytest
import torch

from sampling.logprobs import token_logprobs


def test_logprobs_are_the_unfiltered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    out = token_logprobs(logits, torch.tensor([1, 2]), top=2)
    expected = torch.log_softmax(logits, -1)
    assert math.isclose(out[0].logprob, float(expected[0, 1]), rel_tol=1e-6)
    assert out[0].top_token_ids == [0, 1] and out[1].top_token_ids[0] == 2
    assert math.isclose(out[1].top_logprobs[0], float(expected[1, 2]), rel_tol=1e-6)
    assert sum(math.exp(v) for v in token_logprobs(logits, torch.tensor([0, 0]), top=4)[0].top_logprobs) == (
        pytest.approx(1.0)
    )


def test_top_zero_and_bad_shapes():
    logits = torch.zeros(3, 5)
    assert all(e.top_token_ids == [] for e in token_logprobs(logits, torch.tensor([0, 1, 2]), top=0))
    with pytest.raises(ValueError, match="logits/tokens"):
        token_logprobs(logits, torch.tensor([0]), top=1)
    with pytest.raises(ValueError, match="top"):
        token_logprobs(logits, torch.tensor([0, 1, 2]), top=6)
