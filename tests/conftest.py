import pytest
import torch

from models.loader import load_pair
from sampling.rejection import cupy_available


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
