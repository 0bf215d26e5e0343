"""Every .cu source compiles standalone for CUDA (sm_80, sm_90) and ROCm (gfx90a).

CPU CI has no GPU, but it has nvcc and Debian's hipcc (.ci/run installs it), so both
backends' sources stay valid. Outside CI a missing compiler skips; in CI it fails.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parents[2] / "sampling").glob("*.cu"))


def compiler(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} not found: CI must compile the kernels (see .ci/run)")
        # Outside CI only (CI fails above): a developer machine without the compiler.
        pytest.skip(f"{name} is not installed on this machine")
    return path


def test_there_are_kernel_sources():
    assert [p.name for p in SOURCES] == ["draw_kernel.cu", "rejection_kernel.cu", "tree_kernel.cu"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_with_nvcc(source, arch, tmp_path):
    nvcc = compiler("nvcc")
    result = subprocess.run(
        [nvcc, f"-arch={arch}", "-cubin", "-Werror", "all-warnings", "-o", str(tmp_path / "k.cubin"), str(source)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_with_hipcc(source, tmp_path):
    hipcc = compiler("hipcc")
    result = subprocess.run(
        [hipcc, "--offload-arch=gfx90a", "--genco", "-Werror", "-o", str(tmp_path / "k.hsaco"), str(source)],
        capture_output=True,
        text=True,
        env={**os.environ, "HIP_PLATFORM": "amd"},
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("source", "struct_name", "module"),
    [
        ("draw_kernel.cu", "CdParams", "sampling.cupy_draw"),
        ("draw_kernel.cu", "SmParams", "sampling.cupy_draw"),
        ("rejection_kernel.cu", "RsParams", "sampling.cupy_sampler"),
        ("tree_kernel.cu", "TsParams", "sampling.cupy_tree"),
    ],
)
def test_launch_struct_matches_the_kernel_source(source, struct_name, module):
    """The Python packing of the params struct has one 8-byte field per field of the C struct;
    SmParams ends in an inline array of 2 * SM_INLINE int64, packed after its other fields."""
    import importlib
    import re

    module = importlib.import_module(module)
    params = module._SM_HEADER if struct_name == "SmParams" else module._PARAMS
    text = (Path(__file__).resolve().parents[2] / "sampling" / source).read_text()
    body = re.search(rf"struct {struct_name} \{{(.*?)\}};", text, re.S).group(1)
    fields = [line.split("//")[0].strip() for line in body.splitlines()]
    fields = [f for f in fields if f.endswith(";")]
    if struct_name == "SmParams":
        assert fields.pop() == "long long inline_rows[2 * SM_INLINE];"
        assert int(re.search(r"#define SM_INLINE (\d+)", text).group(1)) == module.INLINE_ROWS
        assert params.size + 16 * module.INLINE_ROWS == module._SM_SIZE
    assert params.size == 8 * len(fields)
    assert list(params.format.lstrip("<")) == ["Q" if "*" in f else "q" for f in fields]


def test_tree_kernel_constants_match_python():
    """The kernel's chunks are those of the inverse-CDF rule, and its block size is the launch's."""
    import re

    from sampling import categorical, cupy_tree

    text = (Path(__file__).resolve().parents[2] / "sampling" / "tree_kernel.cu").read_text()
    assert int(re.search(r"#define TS_CHUNK (\d+)", text).group(1)) == categorical.CHUNK
    assert int(re.search(r"#define TS_THREADS (\d+)", text).group(1)) == cupy_tree.THREADS


def test_draw_kernel_block_size_is_the_launchs():
    import re

    from sampling import cupy_draw

    text = (Path(__file__).resolve().parents[2] / "sampling" / "draw_kernel.cu").read_text()
    assert int(re.search(r"#define CD_THREADS (\d+)", text).group(1)) == cupy_draw.THREADS
