"""CUDA-graph capture and its shape buckets, one implementation for every captured forward (the paged models' steps,
the hidden-state head's drafting depths).

A forward is run once on a side stream first (kernels chosen, workspaces and compiled variants
allocated outside the capture), then captured in `thread_local` mode: the other threads of the
process (the other node of a test, gRPC's) may use the GPU meanwhile. Captures take one lock
per process: two running at once from different threads corrupt each other's graphs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

CAPTURE_LOCK = threading.Lock()


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, smallest): graph shapes come from a few buckets."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def capture_graph(graph: torch.cuda.CUDAGraph, pool, device: torch.device, forward: Callable[[], T]) -> T:
    """Warm `forward` up on a side stream, then capture it into `graph` (its memory from `pool`,
    shared with the caller's other graphs); the outputs of the captured call, which every replay
    rewrites in place."""
    with CAPTURE_LOCK:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            return forward()
