"""What every CuPy kernel launch of `sampling/` shares (a leaf: it imports nothing of the
project's): the device and torch's current stream, and that stream as a CuPy stream (cached per
stream and device), so that a kernel is queued behind the torch work before it, as torch's own
kernels are."""

from __future__ import annotations

import functools

import torch


def current(device: torch.device) -> tuple[int, int]:
    """(the GPU's index, torch's current raw stream on it): what a launch is keyed by. The raw
    pointer is cheaper to ask for than `torch.cuda.current_stream()`'s object."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch._C._cuda_getCurrentRawStream(index)


class _StreamHandle:
    """A raw stream pointer in the CUDA stream protocol, for `cupy.cuda.Stream.from_external`."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@functools.cache
def cupy_stream(stream_ptr: int, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        if hasattr(cupy.cuda.Stream, "from_external"):
            return cupy.cuda.Stream.from_external(_StreamHandle(stream_ptr))
        return cupy.cuda.ExternalStream(stream_ptr, device_index)  # CuPy < 14
