"""Public rejection-sampling API (docs/design.md §2, fixed) and backend selection.

`RejectionSampler` picks its backend once, at construction; `rejection_sample` is the
fixed functional entry point and resolves "auto" from where its inputs live.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch

from common.transfer import cupy_available
from sampling.batch import ChainInputs
from sampling.checks import check_rejection_inputs
from sampling.reference import rejection_sample_torch

Backend = Literal["torch", "cupy", "auto"]
_Impl = Callable[[ChainInputs], tuple[torch.Tensor, torch.Tensor]]


def resolve_backend(backend: str, device: torch.device | str) -> Literal["torch", "cupy"]:
    """ "auto" -> "cupy" on a GPU (CUDA or ROCm builds of torch) when CuPy imports, else "torch"."""
    device = torch.device(device)
    if backend == "auto":
        return "cupy" if device.type == "cuda" and cupy_available() else "torch"
    if backend == "torch":
        return "torch"
    if backend == "cupy":
        if device.type != "cuda":
            raise ValueError(f"backend: 'cupy' expects inputs on a GPU, got device {device}")
        if not cupy_available():
            raise ValueError(
                "backend: 'cupy' requested but CuPy is not importable (install pdspec[cuda] or pdspec[rocm])"
            )
        return "cupy"
    raise ValueError(f"backend: expected 'torch', 'cupy' or 'auto', got {backend!r}")


def _implementation(backend: Literal["torch", "cupy"]) -> _Impl:
    if backend == "torch":
        return rejection_sample_torch
    from sampling.cupy_sampler import rejection_sample_cupy

    return rejection_sample_cupy


class RejectionSampler:
    """Rejection sampler bound to one backend, chosen when it is built."""

    def __init__(self, backend: Backend = "auto", device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self._impl = _implementation(self.backend)

    def __call__(
        self,
        draft_token_ids: torch.Tensor,  # [B, K] int32|int64, target-vocab ids
        draft_probs: torch.Tensor | None,  # [B, K, V] float32, None = point mass at the draft ids
        target_probs: torch.Tensor,  # [B, K+1, V] float32
        target_token_ids: torch.Tensor,  # [B, K+1] int32|int64
        uniform_samples: torch.Tensor,  # [B, K+1] float32 in [0, 1)
        do_sample: torch.Tensor,  # [B] bool
        *,
        check_values: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = ChainInputs(draft_token_ids, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample)
        dims = check_rejection_inputs(inputs, check_values=check_values)
        if dims.batch == 0:
            device = target_probs.device
            return (
                torch.empty(0, dims.num_draft + 1, dtype=torch.int32, device=device),
                torch.empty(0, dtype=torch.int32, device=device),
            )
        return self._impl(inputs)


@functools.cache
def _sampler(backend: Literal["torch", "cupy"]) -> RejectionSampler:
    return RejectionSampler(backend, "cuda" if backend == "cupy" else "cpu")


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_token_ids: torch.Tensor,
    uniform_samples: torch.Tensor,
    do_sample: torch.Tensor,
    backend: Backend = "auto",
    *,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative verification of K draft tokens per row.

    draft_token_ids [B, K] int32|int64 (target-vocab ids); draft_probs [B, K, V] float32
    or None (point mass at the draft ids); target_probs [B, K+1, V] float32 (q after
    temperature/top-k/top-p); target_token_ids [B, K+1] int32|int64 drawn from q;
    uniform_samples [B, K+1] float32 in [0, 1); do_sample [B] bool.

    Returns output_token_ids [B, K+1] int32 (-1 after the last emitted token) and
    accepted_token_num [B] int32 (emitted tokens per row, 1..K+1). Raises ValueError
    for bad inputs before any launch; `check_values=False` skips the checks that need a
    device sync (id and uniform ranges) for callers that validated at their boundary.
    """
    sampler = _sampler(
        resolve_backend(backend, target_probs.device if isinstance(target_probs, torch.Tensor) else "cpu")
    )
    return sampler(
        draft_token_ids,
        draft_probs,
        target_probs,
        target_token_ids,
        uniform_samples,
        do_sample,
        check_values=check_values,
    )
