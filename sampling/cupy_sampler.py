"""CuPy backend of `rejection_sample`: a thin, cached wrapper around rejection_kernel.cu.

The kernel is compiled once per device (NVRTC on CUDA, hiprtc on ROCm; CuPy also caches
the binary on disk) and launched on torch's current stream with raw device pointers:
zero-copy (the kernel reads torch's own memory), where `cupy.from_dlpack` would cost
~30 µs per tensor (the launch figures in docs/design.md §7). All launch arguments travel as one packed struct
(`RsParams` in the .cu file), so marshalling them is one `struct.pack`. Inputs were
validated by `sampling.checks` (dtype, device, shape) and come as one `ChainInputs`
(sampling/batch.py); this module only makes them contiguous.

A call allocates nothing on the device beyond torch's caching allocator (the outputs,
and the workspace the first time a stream needs a larger one) and never synchronises
with the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import numpy as np
import torch

from sampling.batch import ChainInputs
from sampling.cupy_launch import cupy_stream, current

SOURCE = Path(__file__).with_name("rejection_kernel.cu")
KERNEL_NAMES = {True: "rejection_sample_dense", False: "rejection_sample_point_mass"}  # by `dense`
THREADS = 256  # RS_THREADS in the .cu file
MIN_CHUNK = 1024  # vocabulary entries per chunk: one float4 per thread
# RS_DENSE_CHUNK / RS_POINT_CHUNK: a thread holds its share of a chunk in registers, and
# point-mass rows have no p to hold, so their chunks can be twice as long.
MAX_CHUNK = {True: 4096, False: 8192}
BLOCKS_PER_SM = 4  # grid sizing target: blocks (and chunks) per multiprocessor
MAX_GRID_Y = 65535  # rows beyond it are grid-strided inside the kernel
COMPILE_OPTIONS: tuple[str, ...] = ()  # e.g. ("-DRS_MIN_BLOCKS_POINT=2",) for experiments
_PARAMS = struct.Struct("<QqQQQqQQqqqqqqqQQQQ")  # RsParams: 19 fields of 8 bytes
_PARAMS_DTYPE = np.dtype((np.void, _PARAMS.size))


@functools.cache
def _kernels(device_index: int) -> dict:
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=SOURCE.read_text(), options=COMPILE_OPTIONS)
        return {dense: module.get_function(name) for dense, name in KERNEL_NAMES.items()}


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def chunk_size(batch: int, vocab: int, multiprocessors: int, dense: bool) -> int:
    """Entries per chunk: small enough that B = 1 still spans the GPU (~4 chunks per SM)."""
    per_chunk = -(-batch * vocab // (BLOCKS_PER_SM * multiprocessors))
    rounded = -(-per_chunk // MIN_CHUNK) * MIN_CHUNK
    return max(MIN_CHUNK, min(MAX_CHUNK[dense], rounded))


def chunks_per_block(batch: int, num_chunks: int, multiprocessors: int) -> int:
    """Consecutive chunks one block sums: about 4 blocks per SM in all, so each block
    pays its fixed costs (acceptance loads, arrival fence) once for several chunks."""
    blocks_per_row = max(1, min(num_chunks, -(-BLOCKS_PER_SM * multiprocessors // batch)))
    return -(-num_chunks // blocks_per_row)


class _Workspace:
    """Per-(device, stream) scratch: float64 chunk sums and per-row arrival counters.

    The counters are zeroed once, when allocated; the kernel's last block per row puts
    its counter back to 0, so no memset is needed per call (or per graph replay).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums = torch.empty(0, dtype=torch.float64, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)

    def reserve(self, batch: int, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sums.numel() < batch * num_chunks:
            self.sums = torch.empty(
                max(batch * num_chunks, 2 * self.sums.numel()), dtype=torch.float64, device=self.device
            )
        if self.counters.numel() < batch:
            self.counters = torch.zeros(max(batch, 2 * self.counters.numel()), dtype=torch.int32, device=self.device)
        return self.sums, self.counters


_workspaces: dict[tuple[int, int], _Workspace] = {}


def rejection_sample_cupy(inputs: ChainInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """`inputs` (sampling/batch.py: draft ids [B, K], draft probs [B, K, V] or None, target probs
    [B, K+1, V], target ids [B, K+1], uniforms [B, K+1], do_sample [B]) on one GPU, validated."""
    batch, k = inputs.draft_token_ids.shape
    vocab = inputs.target_probs.shape[-1]
    device = inputs.target_probs.device
    index, stream_ptr = current(device)
    draft_token_ids, target_probs, target_token_ids, uniform_samples, do_sample = (
        t.contiguous()
        for t in (
            inputs.draft_token_ids,
            inputs.target_probs,
            inputs.target_token_ids,
            inputs.uniform_samples,
            inputs.do_sample,
        )
    )
    draft_probs = None if inputs.draft_probs is None else inputs.draft_probs.contiguous()

    sms = _multiprocessors(index)
    dense = draft_probs is not None
    chunk = chunk_size(batch, vocab, sms, dense)
    num_chunks = -(-vocab // chunk)
    per_block = chunks_per_block(batch, num_chunks, sms)
    workspace = _workspaces.get((index, stream_ptr))
    if workspace is None:
        workspace = _workspaces[(index, stream_ptr)] = _Workspace(device)
    sums, counters = workspace.reserve(batch, num_chunks)
    out = torch.empty(batch * (k + 2), dtype=torch.int32, device=device)  # ids and counts, one allocation
    output_token_ids = out[: batch * (k + 1)].view(batch, k + 1)
    accepted_token_num = out[batch * (k + 1) :]

    p_ptr = 0 if draft_probs is None else draft_probs.data_ptr()
    q_ptr = target_probs.data_ptr()
    vec = vocab % 4 == 0 and q_ptr % 16 == 0 and p_ptr % 16 == 0
    params = _PARAMS.pack(
        draft_token_ids.data_ptr(),
        draft_token_ids.dtype == torch.int64,
        p_ptr,
        q_ptr,
        target_token_ids.data_ptr(),
        target_token_ids.dtype == torch.int64,
        uniform_samples.data_ptr(),
        do_sample.data_ptr(),
        batch,
        k,
        vocab,
        chunk,
        num_chunks,
        per_block,
        vec,
        output_token_ids.data_ptr(),
        accepted_token_num.data_ptr(),
        sums.data_ptr(),
        counters.data_ptr(),
    )
    grid = (-(-num_chunks // per_block), min(batch, MAX_GRID_Y))
    # A one-element numpy array is passed to the kernel by value: the RsParams struct.
    _kernels(index)[dense](
        grid, (THREADS,), (np.frombuffer(params, _PARAMS_DTYPE),), stream=cupy_stream(stream_ptr, index)
    )
    return output_token_ids, accepted_token_num
