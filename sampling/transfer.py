"""Host -> device copies that do not make the host wait for the device.

A copy from pageable host memory is synchronous: the host waits until the stream has run
everything queued before it, on a decode step a whole forward, and the kernels queued
after the copy then start one launch at a time. Staged through pinned memory the copy is
queued like a kernel and the host goes on queuing the step's work while the forward runs.
torch's pinned-memory cache keeps each staging buffer alive until its copy has run.
"""

from __future__ import annotations

import torch


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory when a GPU is present (a device tensor, or any tensor
    where no GPU is, as it is)."""
    if tensor.device.type != "cpu" or not torch.cuda.is_available() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; a host tensor goes to a GPU asynchronously (through pinned memory)."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return pinned(tensor).to(device, non_blocking=True)


def device_tensor(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)` without a host wait on a GPU."""
    return to_device(torch.tensor(data, dtype=dtype), device)
