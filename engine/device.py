"""The CUDA current device of the thread doing a node's device work.

CUDA's current device is per host thread, and new threads start on device 0; torch takes the
current device for default streams, graph capture and the Triton kernels torch.compile emits.
A node pinned to `cuda:1` runs its steps on gRPC and engine threads, so every entry point into
device work (a decode step, a prefill step) runs under `on_device(device)`.
"""

from __future__ import annotations

import contextlib

import torch


def on_device(device: torch.device | str) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` for a CUDA (or ROCm) device; nothing to do elsewhere."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
