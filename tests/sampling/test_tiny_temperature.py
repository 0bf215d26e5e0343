"""Temperatures below float32's smallest normal value are greedy (one rule: SamplingParams).

At T = 1e-40 (a float32 subnormal) logits / T overflow to -inf everywhere, softmax is NaN
and an inverse-CDF draw lands on id 0: the rule must route such rows to the argmax."""

import torch

from sampling import SamplingParams, SamplingTensors, propose, sample_target
from sampling.params import FLOAT32_TINY
from sampling.proposal import DraftLaw


def test_subnormal_temperature_is_greedy_in_every_sampler():
    logits = torch.tensor([[[-3.0, 1.0, 4.0, 0.5]]])  # [1, 1, 4], argmax 2
    for temperature in (0.0, 1e-40, FLOAT32_TINY / 2):
        params = SamplingParams(do_sample=True, temperature=temperature)
        assert params.is_greedy
        rows = SamplingTensors.from_params([params])
        target = sample_target(logits, rows, torch.tensor([[0.01]]))
        assert int(target.token_ids[0, 0]) == 2 and torch.isfinite(target.probs).all()
        draft = propose(DraftLaw.STOCHASTIC, logits[0], rows, torch.tensor([0.01]))
        assert int(draft.token_ids[0]) == 2
    assert not SamplingParams(do_sample=True, temperature=FLOAT32_TINY).is_greedy
