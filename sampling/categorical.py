"""Inverse-CDF sampling with the tie-breaking rule of docs/design.md §2.

Every sampler in pdspec (target, draft, residual) draws through this one rule so that
the torch reference, the CuPy kernel and the proposal laws agree token for token:
`c = cumsum(w)` in float64, `t = float64(u) * c[-1]`, pick the smallest j with
`w[j] > 0` and `c[j] > t`; if rounding leaves none, the largest j with `w[j] > 0`.

The cumulative sum is taken in two levels, as the CUDA kernel does: float64 sums of
fixed-size chunks, a prefix over the chunk sums to find the chunk that holds the
threshold, then a cumsum inside that chunk only. In exact arithmetic this is the
rule above; in float64 the two summation orders differ only in the last bits (§2).
It also keeps the CPU path fast: one vectorized pass over the row plus one chunk.
"""

from __future__ import annotations

import torch

from common.transfer import cupy_available
from sampling.cupy_draw import categorical_sample_cupy

CHUNK = 1024  # elements per chunk of the first level (fewer when V is smaller)
_SLICE_ELEMENTS = 1 << 20  # float64 slices of at most 8 MB


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`inverse_cdf_sample` where a step draws its tokens: on a GPU with CuPy, one kernel
    (sampling/draw_kernel.cu) instead of the few dozen small torch ops below, whose dispatch
    made a sampled step cost the host several times a greedy one; the same rule elsewhere.
    The torch function stays the reference the kernels are tested against."""
    if weights.is_cuda and weights.dtype == torch.float32 and cupy_available():
        return categorical_sample_cupy(weights, uniforms)
    return inverse_cdf_sample(weights, uniforms)


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one index per row of non-negative, not necessarily normalized weights.

    weights: [N, V] float32 >= 0; uniforms: [N] float32 in [0, 1).
    Returns (index [N] int64, has_mass [N] bool); index is meaningless where has_mass
    is false (all-zero row) and the caller decides the fallback.
    """
    weights = weights.contiguous()
    _rows, vocab = weights.shape
    if vocab <= CHUNK:  # a single chunk: the plain rule, fewer ops for small vocabularies
        cdf = weights.double().cumsum(-1)  # [N, V]
        threshold = uniforms.double() * cdf[:, -1]
        positive = weights > 0
        return _first_or_last(positive & (cdf > threshold[:, None]), positive), cdf[:, -1] > 0
    width = CHUNK
    chunk_sums = _chunk_sums(weights, width)  # [N, C] float64
    chunk_cdf = chunk_sums.cumsum(-1)  # [N, C]
    total = chunk_cdf[:, -1]
    threshold = uniforms.double() * total  # [N]
    chunk = _first_or_last(chunk_cdf > threshold[:, None], chunk_sums > 0)  # [N] chunk holding t
    before = torch.nn.functional.pad(chunk_cdf, (1, 0))[:, :-1].gather(1, chunk[:, None])  # [N, 1] mass before it

    offsets = chunk[:, None] * width + torch.arange(width, device=weights.device)  # [N, width]
    inside = offsets < vocab
    local = weights.gather(1, offsets.clamp(max=vocab - 1)) * inside  # [N, width], 0 past the end
    cdf = before + local.double().cumsum(-1)
    positive = local > 0
    index = chunk * width + _first_or_last(positive & (cdf > threshold[:, None]), positive)
    return index, total > 0


def _chunk_sums(weights: torch.Tensor, width: int) -> torch.Tensor:
    """[N, V] float32 -> [N, ceil(V / width)] float64 sums of consecutive chunks."""
    rows, vocab = weights.shape
    # Convert to float64 a few MB of rows at a time: on the CPU a temporary above glibc's
    # 32 MB mmap threshold is a fresh mapping every call, whose page faults cost more
    # than the sums themselves (64 rows x 128256 took 35 ms in one go, 4 ms in slices).
    step = rows_per_slice(vocab, weights.device)
    return torch.cat([_chunk_sums_slice(weights[i : i + step], width) for i in range(0, max(rows, 1), step)])


def rows_per_slice(vocab: int, device: torch.device) -> int:
    """Rows of V elements per slice: 8 MB of float64 on the CPU, unsliced on a GPU."""
    if device.type != "cpu":
        return 1 << 62
    return max(1, _SLICE_ELEMENTS // vocab)


def _chunk_sums_slice(weights: torch.Tensor, width: int) -> torch.Tensor:
    rows, vocab = weights.shape
    full = vocab // width
    sums = weights[:, : full * width].view(rows, full, width).sum(-1, dtype=torch.float64)
    if vocab % width:
        sums = torch.cat([sums, weights[:, full * width :].sum(-1, dtype=torch.float64, keepdim=True)], dim=1)
    return sums


def _first_or_last(hit: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """[N, L] masks -> [N] int64: first True of `hit`, else last True of `fallback` (0 if none)."""
    length = hit.shape[-1]
    first_hit = hit.byte().argmax(-1)  # argmax returns the first maximal index
    last_fallback = length - 1 - fallback.flip(-1).byte().argmax(-1)
    last_fallback = torch.where(fallback.any(-1), last_fallback, 0)
    return torch.where(hit.any(-1), first_hit, last_fallback)
