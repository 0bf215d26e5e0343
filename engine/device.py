"""The CUDA current device of the thread doing a node's device work.

CUDA's current device is per host thread, and new threads start on device 0; torch takes the
current device for default streams, graph capture and the Triton kernels torch.compile emits.
A node pinned to `cuda:1` runs its steps on gRPC and engine threads, so every entry point into
device work (a decode step, a prefill step) runs under `on_device(device)`.

`serve_attention_without_cudnn`: what the engines' SDPA calls may run on a GPU.
"""

from __future__ import annotations

import contextlib

import torch


def on_device(device: torch.device | str) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` for a CUDA (or ROCm) device; nothing to do elsewhere."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def serve_attention_without_cudnn(device: torch.device | str) -> None:
    """On a GPU, take cuDNN's backend out of SDPA's choice, for the whole process (flash,
    memory-efficient and math attention stay). cuDNN's attention builds a graph for every new
    shape (a prompt length: ~40 ms more than the call itself on an H100) and, on a machine whose
    driver has not cached its kernels yet, JIT-compiles each kernel variant at its first use
    (0.5-0.8 s each: the first prompts of 43, 44, 46 and 48 tokens on SmolLM2's shape, where the
    prefill's attention leaves the Triton kernel for SDPA). Without it a length's first prefill
    costs what its next one does, and the steady prefill is no slower (BENCHMARKS.md)."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
