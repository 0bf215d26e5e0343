"""Compile engine/triton_attention's kernels for GPU targets on a machine without a GPU.

    python tests/engine/kernel_targets.py   # one JSON object per (target, kernel variant)

Triton lowers a kernel for a named target without a device: CUDA through its bundled ptxas,
ROCm through its bundled LLVM AMDGPU backend and linker. Each line gives the variant, the
target, the binary's kind and the shared memory (LDS on ROCm) it needs against the target's
limit. tests/engine/test_kernel_targets.py runs this in a fresh process: Triton's interpreter,
which the CPU tests of the kernel turn on, cannot compile.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import triton_attention as kernels

# (name, backend, arch, warp size, shared memory per block at most in bytes). Not sm_90: the
# GPU tests run the kernels on an H200, so only the targets no test device has are built here.
TARGETS = [
    ("sm_80", "cuda", 80, 32, 166912),  # A100: 163 KiB opt-in
    ("gfx90a", "hip", "gfx90a", 64, 65536),  # MI200: 64 KiB LDS
    ("gfx942", "hip", "gfx942", 64, 65536),  # MI300
]
STRIDES = ["stride_qr", "stride_qq", "stride_qh", "stride_plane", "stride_slot", "stride_head"]
STRIDES += ["stride_sr", "stride_mr", "stride_mq", "rows", "width", "queries"]
# What paged_attention launches: (dtype, queries Q, query heads per KV head G, head dim D, one
# split), and the backends it is built for
SPLIT_VARIANTS = [
    (("bf16", 1, 4, 128, True), ("cuda", "hip")),  # a Llama-3-8B decode step, up to 128 keys
    (("bf16", 5, 4, 128, False), ("cuda", "hip")),  # its verify pass at K = 4, several splits merged
    # the largest packed tile, G * Q = 128 queries: what it checks is the 64 KiB of LDS (its 80 KiB
    # fit sm_80's shared memory twice, and ptxas takes 22 s over it)
    (("fp16", 32, 4, 128, False), ("hip",)),
    (("fp32", 2, 3, 64, False), ("cuda", "hip")),  # a float32 model (IEEE dots), GQA 9/3
]


def split_source(dtype: str, queries: int, group: int, dim: int, direct: bool) -> ASTSource:
    signature = {
        "q_ptr": f"*{dtype}",
        "kv_ptr": f"*{dtype}",
        "slots_ptr": "*i64",
        "count_ptr": "*i64",
        "mask_ptr": "*u8",
        "out_ptr": f"*{dtype}",
        "part_ptr": "*fp32",
        "lse_ptr": "*fp32",
        **dict.fromkeys(STRIDES, "i32"),
        "scale_log2": "fp32",
    }
    constants = {
        "G": group,
        "HQ": 8 * group,
        "D": dim,
        "BLOCK_M": kernels.block_m(queries, group),
        "BLOCK_D": max(16, triton.next_power_of_2(dim)),
        "BLOCK_N": kernels.BLOCK_N,
        "SPLIT": kernels.SPLIT,
        "DIRECT": direct,
        "IEEE": dtype == "fp32",
    }
    return ASTSource(kernels._split_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)


def merge_source(dtype: str, dim: int) -> ASTSource:
    signature = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dtype}", "total": "i32", "splits": "i32"}
    constants = {"D": dim, "BLOCK_D": max(16, triton.next_power_of_2(dim))}
    return ASTSource(kernels._merge_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)


def main() -> None:
    sources = [(f"split {v}", split_source(*v), backends) for v, backends in SPLIT_VARIANTS]
    sources.append(("merge bf16 128", merge_source("bf16", 128), ("cuda", "hip")))
    for name, backend, arch, warp, shared_limit in TARGETS:
        target = GPUTarget(backend, arch, warp)
        for variant, source, backends in sources:
            if backend not in backends:
                continue
            compiled = triton.compile(source, target=target)
            binary = "cubin" if backend == "cuda" else "hsaco"
            line = {
                "target": name,
                "variant": variant,
                "binary_bytes": len(compiled.asm[binary]),
                "shared": compiled.metadata.shared,
                "shared_limit": shared_limit,
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
