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
    """Assert max |got - want| <= bound(want, steps, dtype) over the finite entries of `want`, and
    that its infinite entries (logits a vocabulary mask sets to -inf) are exactly those of `got`;
    returns the difference."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    infinite = torch.isinf(want)
    if bool(infinite.any()):
        assert torch.equal(torch.isinf(got), infinite) and torch.equal(got[infinite], want[infinite]), (
            "the infinite entries differ"
        )
        got, want = got[~infinite], want[~infinite]
    if not want.numel():
        return 0.0
    diff = float((got.detach().double() - want.detach().double()).abs().max())
    limit = bound(want, steps, dtype)
    assert diff <= limit, (
        f"max |got - want| = {diff:.3e} > {limit:.3e} "
        f"({steps:.0f} roundings at eps({dtype or want.dtype}), magnitude {float(want.abs().max()):.3g})"
    )
    return diff
