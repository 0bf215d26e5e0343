import os

import pytest
import torch

from models.loader import load_pair
from sampling.rejection import cupy_available


def pytest_configure(config):
    """Under pytest-xdist the workers are the parallelism (make test: 2 workers on 2 cores): one
    intra-op torch thread each. Two threads per worker oversubscribe the cores, and torch's
    OpenMP threads spin while they wait for each other: the real-model tests ran 10-30x slower
    beside another worker (test_smollm2_matches_transformers: 3 s alone, 108 s in make test)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pair():
    """The built-in model pair (trained once, then read from the cache)."""
    return load_pair()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and cupy_available():
        return
    # gpu tests need a CUDA/ROCm device and CuPy; CPU CI has neither (make test-gpu runs them).
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
