"""Tolerances for comparing two evaluations of the same floating-point math.

Two implementations of one computation (pdspec's Llama against transformers, a batched forward
against one row at a time, the paged pool against a contiguous cache) differ only in the order
in which they accumulate: blocking, fused kernels and the thread count (which moves with load
and with pytest's workers) all change it. A fixed bound such as 1e-4 sits inside that noise on a
large model and far above it on a tiny one, so it either fails at random or hides bugs.

The bound here is derived instead: every rounding moves a result by at most one unit of the
dtype's epsilon at the scale of the values involved, and a reduction of length n in a different
order accumulates about sqrt(n) such units (the random-walk model of rounding error). A
transformer forward is `layers` such reductions of length `hidden` in sequence, so two
evaluations of its logits agree to

    eps(dtype) * max|logits| * layers * sqrt(hidden)

which is 10-20x what is measured across thread counts, and still thousands of times below what
any real bug (a wrong rotary angle, mask, scale or weight) produces: those move logits by O(1).
"""

from __future__ import annotations

import math

import torch


def roundings(layers: int, hidden: int) -> float:
    """The rounding steps on the path of one logit through `layers` layers of width `hidden`."""
    return max(layers, 1) * math.sqrt(hidden)


def model_roundings(model) -> float:
    """`roundings` of a model: its depth and width (models/llama.LlamaConfig, or the transformers
    config of the HF backend)."""
    config = getattr(model, "config", None) or model.model.config
    return roundings(getattr(config, "num_layers", None) or config.num_hidden_layers, config.hidden_size)


def bound(want: torch.Tensor, steps: float, dtype: torch.dtype | None = None) -> float:
    """The largest difference two evaluations of `want` may show after `steps` roundings in `dtype`
    (default: `want`'s own)."""
    eps = torch.finfo(dtype or want.dtype).eps
    return eps * max(float(want.detach().abs().max()), 1.0) * steps


def assert_fp_close(got: torch.Tensor, want: torch.Tensor, steps: float, dtype: torch.dtype | None = None) -> float:
    """Assert max |got - want| <= bound(want, steps, dtype) over the finite entries, and the same
    non-finite entries (a masked logit is -inf in both); returns the difference."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    dtype = dtype or want.dtype
    got, want = got.detach().double(), want.detach().double()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), "non-finite entries differ"
    assert torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num()), "non-finite entries differ"
    got, want = got[finite], want[finite]
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    limit = bound(want, steps, dtype) if want.numel() else 0.0
    magnitude = float(want.abs().max()) if want.numel() else 0.0
    assert diff <= limit, (
        f"max |got - want| = {diff:.3e} > {limit:.3e} ({steps:.0f} roundings, magnitude {magnitude:.3g})"
    )
    return diff
