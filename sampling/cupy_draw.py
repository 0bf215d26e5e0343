"""CuPy launches of draw_kernel.cu: a sampled step's per-row draws in one kernel each.

`categorical_sample_cupy` is `inverse_cdf_sample` (sampling/categorical.py) on a GPU, and
`splitmix64_cupy` the uniforms of sampling/rng.py. In torch each is a few dozen small ops,
whose dispatch was most of what a sampled decode step cost over a greedy one on the host; here
each is one launch on torch's current stream, reading and writing torch's memory through raw
pointers (as sampling/cupy_sampler.py does), allocating only the outputs and never waiting
for the device. A small stream batch's rows travel in the launch's parameters: no host ->
device copy at all. Shapes, dtypes and devices are the callers' (checked there).
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import numpy as np
import torch

from common.transfer import to_device
from sampling.cupy_launch import cupy_stream, current

SOURCE = Path(__file__).with_name("draw_kernel.cu")
THREADS = 256  # CD_THREADS in the .cu file
MAX_GRID = 65535  # rows past it are grid-strided inside the kernel
_PARAMS = struct.Struct("<QQQQqqq")  # CdParams: 7 fields of 8 bytes
INLINE_ROWS = 64  # SM_INLINE in the .cu file
_SM_HEADER = struct.Struct("<QQqqq")  # SmParams' 5 fields of 8 bytes before its inline rows
_SM_SIZE = _SM_HEADER.size + 16 * INLINE_ROWS  # and INLINE_ROWS (state, count) int64 pairs


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


def splitmix64_cupy(rows_in: torch.Tensor, n: int, stream: bool, device: torch.device) -> torch.Tensor:
    """[B, n] float32 on `device` (a GPU). rows_in int64, on the host or on `device`: [B, 1 + n]
    (key, then the n counters: `splitmix64_uniforms(key, counters)`) or, with `stream`, [B, 2]
    (the state before the row's next value, its count: the count's next values, then zeros).
    Host stream rows of a batch of at most INLINE_ROWS are the launch's parameters; other host
    rows are copied to the device first."""
    batch = rows_in.shape[0]
    out = torch.empty(batch, n, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out
    if stream and rows_in.device.type == "cpu" and batch <= INLINE_ROWS:
        header = _SM_HEADER.pack(0, out.data_ptr(), batch, n, 1)
        rows = rows_in.contiguous().numpy().tobytes()  # 16 bytes a row
        params = header + rows + bytes(_SM_SIZE - len(header) - len(rows))
    else:
        rows_in = to_device(rows_in.contiguous(), device)
        params = _SM_HEADER.pack(rows_in.data_ptr(), out.data_ptr(), batch, n, stream)
        params += bytes(_SM_SIZE - len(params))
    kernels, cupy_stream = _launch(out.device)
    blocks = min(-(-out.numel() // THREADS), MAX_GRID)
    kernels["splitmix64_uniforms"]((blocks,), (THREADS,), (_by_value(params),), stream=cupy_stream)
    return out


def _by_value(packed: bytes) -> np.ndarray:
    """A one-element numpy array of the packed struct: CuPy passes it to the kernel by value."""
    return np.frombuffer(packed, np.dtype((np.void, len(packed))))
