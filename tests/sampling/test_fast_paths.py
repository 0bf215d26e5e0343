"""The samplers' host-flag shortcuts (all greedy, no filter, argmax for one candidate) give
the same tensors as the general path, which the conservative flags force."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sampling import SamplingParams, SamplingTensors
from sampling.filtering import filtered_probs
from sampling.proposal import DraftLaw, propose_candidates
from sampling.target_sampler import sample_target
from sampling.verifier import VerifyResult

V = 97

MIXES = {
    "all greedy": [SamplingParams()] * 5,
    "plain sampling": [SamplingParams(do_sample=True, temperature=0.7)] * 5,
    "greedy and sampled": [SamplingParams(), SamplingParams(do_sample=True), SamplingParams(top_k=1, do_sample=True)],
    "filters": [SamplingParams(do_sample=True, top_k=5), SamplingParams(do_sample=True, top_p=0.8), SamplingParams()],
}


def general(params: SamplingTensors) -> SamplingTensors:
    """The same rows with the flags that take every general path."""
    return dataclasses.replace(params, needs_filter=True, any_greedy=True, all_greedy=False)


def tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid, so rows hold ties at their maximum (the argmax rule is tested)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (rows, V), generator=gen).float()


@pytest.mark.parametrize("mix", list(MIXES))
def test_flags_are_exact_and_shortcuts_equal_the_general_path(mix):
    params = MIXES[mix]
    rows = SamplingTensors.from_params(params)
    assert rows.all_greedy == all(p.is_greedy for p in params)
    assert rows.any_greedy == any(p.is_greedy for p in params)
    assert rows.needs_filter == any(p.top_k > 0 or p.effective_top_p < 1 for p in params)
    logits = tied_logits(len(params), seed=len(mix))
    assert torch.equal(filtered_probs(logits, rows), filtered_probs(logits, general(rows)))
    steps = 3
    target_logits = tied_logits(len(params) * steps, seed=1).view(len(params), steps, V)
    uniforms = torch.rand(len(params), steps, generator=torch.Generator().manual_seed(2))
    fast, slow = (sample_target(target_logits, r, uniforms) for r in (rows, general(rows)))
    assert torch.equal(fast.probs, slow.probs) and torch.equal(fast.token_ids, slow.token_ids)
    for law in DraftLaw:
        fast, slow = (
            propose_candidates(law, logits, r, uniforms[:, :1].contiguous(), 1) for r in (rows, general(rows))
        )
        assert torch.equal(fast.token_ids, slow.token_ids) and torch.equal(fast.valid, slow.valid)
        assert (fast.probs is None) == (slow.probs is None)
        if fast.probs is not None:
            assert torch.equal(fast.probs, slow.probs)


def test_subsets_keep_safe_flags():
    rows = SamplingTensors.from_params(MIXES["greedy and sampled"])
    picked = rows.select([0])  # greedy alone: the flags stay the parent's (general path, same result)
    assert (picked.needs_filter, picked.any_greedy, picked.all_greedy) == (True, True, False)
    assert picked.repeat_rows(3).greedy.tolist() == [True] * 3


def test_one_candidate_is_the_first_of_a_stable_sort():
    logits = tied_logits(64, seed=3)
    top = propose_candidates(DraftLaw.POINT_MASS, logits, SamplingTensors.from_params([SamplingParams()] * 64), None, 1)
    assert torch.equal(top.token_ids[:, 0], logits.sort(dim=-1, descending=True, stable=True).indices[:, 0])


def test_host_transfer_unpacks_tokens_and_tree_nodes():
    output = torch.tensor([[5, 6, -1], [7, -1, -1]], dtype=torch.int32)
    counts = torch.tensor([2, 1], dtype=torch.int32)
    stats = None  # host() reads only the tokens, the counts and the nodes
    assert VerifyResult(output, counts, stats).host() == ([[5, 6], [7]], None)
    nodes = torch.tensor([[3, -1], [-1, -1]], dtype=torch.int32)
    assert VerifyResult(output, counts, stats, nodes).host() == ([[5, 6], [7]], [[3], []])


def test_a_batch_whose_rows_repeat_reuses_its_tensors_and_they_hold_each_rows_values():
    """One copy builds a batch's tensors (float64 on the way: the float32 values and top-k exact),
    and a later step with the same rows gets the same tensors, a different batch its own."""
    params = [
        SamplingParams(do_sample=True, temperature=0.1 + 1e-9, top_k=2**24 + 1, top_p=0.3),  # not a float32
        SamplingParams(),  # greedy: temperature 1 (never divided by 0)
        SamplingParams(do_sample=True, temperature=1e-39),  # subnormal: greedy
        SamplingParams(do_sample=True, top_p=0.0, seed=2**64 - 1),  # top_p 0 disables
    ]
    first = SamplingTensors.from_params(params)
    assert first.greedy.tolist() == [False, True, True, False]
    as_float32 = torch.tensor([0.1 + 1e-9, 1.0, 1.0, 1.0, 0.3], dtype=torch.float32).tolist()
    assert first.temperature.dtype == torch.float32 and first.temperature.tolist() == as_float32[:4]
    assert first.top_k.dtype == torch.int64 and first.top_k.tolist() == [2**24 + 1, 0, 0, 0]
    assert first.top_p.dtype == torch.float32 and first.top_p.tolist() == [as_float32[4], 1.0, 1.0, 1.0]
    assert (first.needs_filter, first.any_greedy, first.all_greedy) == (True, True, False)
    again = SamplingTensors.from_params(list(params))
    assert again.temperature is first.temperature  # the same rows: nothing copied
    other = SamplingTensors.from_params(params[:3])
    assert other.temperature is not first.temperature and other.temperature.shape == (3,)
