"""The Triton paged-attention kernels build for CUDA sm_80 and ROCm (gfx90a, gfx942) on
this GPU-less machine, in every variant the engine launches, within each target's shared memory
(LDS) per block. Where no AMD GPU is at hand this is the ROCm check of the attention kernel, as
tests/sampling/test_kernel_compile.py is for the CuPy kernels (hipcc)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: the interpreter tests (test_triton_attention.py) must be the first to import
# Triton in a worker, after they set TRITON_INTERPRET; the build runs in its own process.
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (the dev extra on Linux has it)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("kernel_targets.py")


def test_the_attention_kernels_compile_for_cuda_and_rocm_targets():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter cannot compile
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert {line["target"] for line in lines} == {"sm_80", "gfx90a", "gfx942"}
    assert len(lines) == 3 * 5 - 1  # the largest tile is built for the ROCm targets only
    for line in lines:
        assert line["binary_bytes"] > 0, line
        assert 0 < line["shared"] <= line["shared_limit"] or line["variant"].startswith("merge"), line
