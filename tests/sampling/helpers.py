"""Shared test helpers: random rejection-sampling inputs, well-formed arguments to corrupt one at
a time (the validation tests), the biased sampler, chi-square."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from sampling import ChainInputs
from sampling.reference import acceptance_mask, emit_tokens
from tests.sampling.tree_inputs import NAMES as TREE_NAMES
from tests.sampling.tree_inputs import random_tree_inputs

ALPHA = 1e-6
# The verification backends, for tests that hold each of them to the same checks: the torch
# reference everywhere, the CuPy kernels on a GPU (make test-gpu).
BACKENDS = [pytest.param("torch", id="torch"), pytest.param("cupy", id="cupy", marks=pytest.mark.gpu)]
BACKEND_DEVICE = {"torch": "cpu", "cupy": "cuda"}
# The argument order of rejection_sample.
CHAIN_NAMES = ["draft_token_ids", "draft_probs", "target_probs", "target_token_ids", "uniform_samples", "do_sample"]


def random_inputs(
    batch: int,
    k: int,
    vocab: int,
    *,
    seed: int,
    dense: bool = True,
    device: str = "cpu",
    sharpness: float = 3.0,
    greedy_fraction: float = 0.3,
    on_device: bool = False,
):
    """Well-formed inputs: q = softmax(sharpness*randn), p a noisy copy, ids drawn from them
    (point masses: p's argmax). Drawn on the CPU and moved to `device`, or with `on_device`
    drawn on `device` by its own generator (large V stays fast on a GPU; other draws)."""
    where = device if on_device else "cpu"
    gen = torch.Generator(device=where).manual_seed(seed)
    logits = sharpness * torch.randn(batch, k + 1, vocab, generator=gen, device=where)
    target_probs = torch.softmax(logits, -1)
    draft_probs = torch.softmax(logits[:, :k] + torch.randn(batch, k, vocab, generator=gen, device=where), -1)
    flat_p = draft_probs.reshape(-1, vocab)
    flat_q = target_probs.reshape(-1, vocab)
    draft_ids = torch.zeros(batch, k, dtype=torch.int64, device=where)
    if batch * k and (dense or not on_device):  # the CPU stream draws p's ids for point masses too
        draft_ids = torch.multinomial(flat_p, 1, generator=gen).view(batch, k)
    target_ids = (
        torch.multinomial(flat_q, 1, generator=gen).view(batch, k + 1)
        if batch
        else torch.zeros(0, k + 1, dtype=torch.int64, device=where)
    )
    if not dense and batch * k:
        draft_ids = flat_p.argmax(-1).view(batch, k)
    uniforms = torch.rand(batch, k + 1, generator=gen, device=where)
    do_sample = torch.rand(batch, generator=gen, device=where) >= greedy_fraction
    args = (draft_ids, draft_probs if dense else None, target_probs, target_ids, uniforms, do_sample)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def gpu_inputs(
    batch: int, k: int, vocab: int, *, seed: int, dense: bool, device: str = "cuda", greedy_fraction: float = 0.3
):
    """random_inputs drawn directly on a GPU."""
    return random_inputs(
        batch, k, vocab, seed=seed, dense=dense, device=device, greedy_fraction=greedy_fraction, on_device=True
    )


def good_chain_args() -> list:
    """Well-formed rejection_sample arguments: B = 4, K = 3, V = 11."""
    return list(random_inputs(4, 3, 11, seed=0))


def good_tree_args() -> list:
    """Well-formed tree_rejection_sample arguments: B = 4 rows of N = 3 nodes each, V = 11."""
    args = list(random_tree_inputs(4, 3, 11, seed=0, ragged=False))
    args[TREE_NAMES.index("num_nodes")] = torch.full((4,), 3)
    return args


def with_arg(args: list, names: list[str], name: str, value, index=None) -> list:
    """A copy of the argument list `args` (in the order of `names`) with argument `name`
    replaced by `value`, or with `index`, by a copy of it whose entry at `index` is `value`."""
    args = list(args)
    position = names.index(name)
    if index is not None:
        tensor = args[position].clone()
        tensor[index] = value
        value = tensor
    args[position] = value
    return args


def biased_rejection_sample(draft_token_ids, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample):
    """A WRONG sampler: equal draft/target ids bypass the u*p < q test on stochastic rows, and
    rows under the greedy rule (greedy, or point masses verified by coupling) accept their
    first draft whatever the target drew.

    Kept so the statistical tests prove they can detect a biased sampler.
    """
    inputs = ChainInputs(draft_token_ids, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample)
    accepted = acceptance_mask(inputs)
    k = draft_token_ids.shape[1]
    accepted |= do_sample[:, None] & (target_token_ids[:, :k].long() == draft_token_ids.long())
    if k:
        accepted[:, 0] |= ~do_sample
    return emit_tokens(accepted, inputs)


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to probs; bins with expected count < 5 are merged."""
    n = samples.numel()
    observed = np.bincount(samples.cpu().numpy(), minlength=probs.numel()).astype(np.float64)
    probs = probs.double().cpu().numpy()
    assert observed[probs == 0].sum() == 0, "a zero-probability token was sampled"
    expected = probs / probs.sum() * n
    order = np.argsort(expected)
    obs_bins, exp_bins = [], []
    acc_o = acc_e = 0.0
    for j in order:  # merge the smallest bins until each merged bin expects >= 5
        acc_o += observed[j]
        acc_e += expected[j]
        if acc_e >= 5:
            obs_bins.append(acc_o)
            exp_bins.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0 or acc_o > 0:
        if exp_bins:
            obs_bins[-1] += acc_o
            exp_bins[-1] += acc_e
        else:
            obs_bins.append(acc_o)
            exp_bins.append(acc_e)
    if len(exp_bins) < 2:
        return 1.0
    return float(stats.chisquare(obs_bins, exp_bins).pvalue)
