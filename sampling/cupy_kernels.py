"""Every CuPy kernel of `sampling/`, compiled and loaded on a device at a node's start-up.

Each module's kernels are compiled (NVRTC on CUDA, hiprtc on ROCm; or read from CuPy's disk
cache) and loaded by their first launch. On a fresh machine or container that cache is empty,
and the first request to launch a kernel (the first sampled request, for the draws and their
uniforms) waited for the compile. A node therefore loads them all while it starts
(`engine/paged_lm.paged_pair`), before it reports SERVING.
"""

from __future__ import annotations

import torch

from sampling import cupy_draw, cupy_sampler, cupy_tree
from sampling.cupy_launch import current

MODULES = (cupy_sampler, cupy_tree, cupy_draw)  # the rejection chain, the tree, the draws


def load_kernels(device: torch.device) -> None:
    """Compile and load every module's kernels on `device` (a GPU; CuPy importable)."""
    index, _ = current(device)
    for module in MODULES:
        module._kernels(index)
