"""CuPy launches of draw_kernel.cu: a sampled step's per-row draws in one kernel each.

`categorical_sample_cupy` is `inverse_cdf_sample` (sampling/categorical.py) on a GPU, and
`splitmix64_cupy` the uniforms of sampling/rng.py. In torch each is a few dozen small ops,
whose dispatch was most of what a sampled decode step cost over a greedy one on the host; here
each is one launch on torch's current stream, reading and writing torch's memory through raw
pointers (as sampling/cupy_sampler.py does), allocating only the outputs and never waiting
for the device. Shapes, dtypes and devices are the callers' (checked there).
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import numpy as np
import torch

from sampling.cupy_launch import cupy_stream, current

SOURCE = Path(__file__).with_name("draw_kernel.cu")
THREADS = 256  # CD_THREADS in the .cu file
MAX_GRID = 65535  # rows past it are grid-strided inside the kernel
_PARAMS = struct.Struct("<QQQQqqq")  # CdParams: 7 fields of 8 bytes
_SM_PARAMS = struct.Struct("<QQqqq")  # SmParams: 5 fields of 8 bytes


@functools.cache
def _kernels(device_index: int) -> dict:
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=SOURCE.read_text())
        return {name: module.get_function(name) for name in ("categorical_sample", "splitmix64_uniforms")}


def _launch(device: torch.device) -> tuple[dict, object]:
    index, stream_ptr = current(device)
    return _kernels(index), cupy_stream(stream_ptr, index)


def categorical_sample_cupy(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [N, V] float32 >= 0 on a GPU; uniforms [N] float32 in [0, 1) on the same GPU.
    Returns (index [N] int64, has_mass [N] bool), as `inverse_cdf_sample`."""
    weights = weights.contiguous()
    uniforms = uniforms.contiguous()
    rows, vocab = weights.shape
    index = torch.empty(rows, dtype=torch.int64, device=weights.device)
    has_mass = torch.empty(rows, dtype=torch.bool, device=weights.device)
    if rows == 0:
        return index, has_mass
    vec = vocab % 4 == 0 and weights.data_ptr() % 16 == 0
    params = _PARAMS.pack(
        weights.data_ptr(), uniforms.data_ptr(), index.data_ptr(), has_mass.data_ptr(), rows, vocab, vec
    )
    kernels, stream = _launch(weights.device)
    kernels["categorical_sample"]((min(rows, MAX_GRID),), (THREADS,), (_by_value(params),), stream=stream)
    return index, has_mass


def splitmix64_cupy(rows_in: torch.Tensor, n: int, stream: bool) -> torch.Tensor:
    """[B, n] float32 on rows_in's GPU. rows_in int64: [B, 1 + n] (key, then the n counters:
    `splitmix64_uniforms(key, counters)`) or, with `stream`, [B, 2] (the state before the row's
    next value, its count: the count's next values, then zeros)."""
    rows_in = rows_in.contiguous()
    batch = rows_in.shape[0]
    out = torch.empty(batch, n, dtype=torch.float32, device=rows_in.device)
    if out.numel() == 0:
        return out
    kernels, cupy_stream = _launch(rows_in.device)
    blocks = min(-(-out.numel() // THREADS), MAX_GRID)
    params = _SM_PARAMS.pack(rows_in.data_ptr(), out.data_ptr(), batch, n, stream)
    kernels["splitmix64_uniforms"]((blocks,), (THREADS,), (_by_value(params),), stream=cupy_stream)
    return out


def _by_value(packed: bytes) -> np.ndarray:
    """A one-element numpy array of the packed struct: CuPy passes it to the kernel by value."""
    return np.frombuffer(packed, np.dtype((np.void, len(packed))))
