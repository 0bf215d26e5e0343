"""CuPy backend of `tree_rejection_sample`: a thin, cached wrapper around tree_kernel.cu.

Launched like the chain kernel (sampling/cupy_sampler.py): compiled once per device,
run on torch's current stream with raw device pointers in one packed struct (`TsParams`
in the .cu file). Inputs come as one `TreeInputs` (sampling/batch.py), validated by
`sampling.checks.check_tree_inputs`; this module only makes them contiguous.

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

from sampling.batch import TreeInputs
from sampling.categorical import CHUNK
from sampling.cupy_launch import cupy_stream, current

SOURCE = Path(__file__).with_name("tree_kernel.cu")
KERNEL_NAMES = {True: "tree_rejection_sample_dense", False: "tree_rejection_sample_point_mass"}  # by `dense`
THREADS = 512  # TS_THREADS in the .cu file
MAX_GRID = 65535  # rows beyond it are grid-strided inside the kernel
_PARAMS = struct.Struct("<QqQqQqQQQqQQQqqqqqQQQQQ")  # TsParams: 23 fields of 8 bytes
_PARAMS_DTYPE = np.dtype((np.void, _PARAMS.size))


@functools.cache
def _kernels(device_index: int) -> dict:
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=SOURCE.read_text())
        return {dense: module.get_function(name) for dense, name in KERNEL_NAMES.items()}


class _Workspace:
    """Per-(device, stream) scratch: each row's residual W and the float64 sums of its chunks.

    Every rejection rewrites its row's W and sums in full before anything reads them, so
    stale contents never matter and no memset is needed per call (or per graph replay).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.residual = torch.empty(0, dtype=torch.float32, device=device)
        self.sums = torch.empty(0, dtype=torch.float64, device=device)

    def reserve(self, batch: int, vocab: int, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.residual.numel() < batch * vocab:
            self.residual = torch.empty(
                max(batch * vocab, 2 * self.residual.numel()), dtype=torch.float32, device=self.device
            )
        if self.sums.numel() < batch * num_chunks:
            self.sums = torch.empty(
                max(batch * num_chunks, 2 * self.sums.numel()), dtype=torch.float64, device=self.device
            )
        return self.residual, self.sums


_workspaces: dict[tuple[int, int], _Workspace] = {}


def tree_rejection_sample_cupy(inputs: TreeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`inputs` (sampling/batch.py: draft ids and parents [B, N], num_nodes [B] or None, draft
    probs [B, N, V] or None, target probs [B, N+1, V], target ids [B, N+1], accept uniforms
    [B, N], recover uniforms [B, N+1], do_sample [B]) on one GPU, validated. Returns the fields
    of `sampling.tree.TreeResult` (output_token_ids, accepted_token_num, accepted_nodes): tree.py
    wraps them, as the backend it loads lazily must not import it back."""
    batch, n_nodes = inputs.draft_token_ids.shape
    vocab = inputs.target_probs.shape[-1]
    device = inputs.target_probs.device
    index, stream_ptr = current(device)
    draft_token_ids, parents, target_probs, target_token_ids, accept_uniforms, recover_uniforms, do_sample = (
        t.contiguous()
        for t in (
            inputs.draft_token_ids,
            inputs.parents,
            inputs.target_probs,
            inputs.target_token_ids,
            inputs.accept_uniforms,
            inputs.recover_uniforms,
            inputs.do_sample,
        )
    )
    num_nodes = None if inputs.num_nodes is None else inputs.num_nodes.contiguous()
    draft_probs = None if inputs.draft_probs is None else inputs.draft_probs.contiguous()

    num_chunks = -(-vocab // CHUNK)
    workspace = _workspaces.get((index, stream_ptr))
    if workspace is None:
        workspace = _workspaces[(index, stream_ptr)] = _Workspace(device)
    residual, sums = workspace.reserve(batch, vocab, num_chunks)
    out = torch.empty(batch * (2 * n_nodes + 2), dtype=torch.int32, device=device)  # all outputs, one allocation
    output_token_ids = out[: batch * (n_nodes + 1)].view(batch, n_nodes + 1)
    accepted_nodes = out[batch * (n_nodes + 1) : batch * (2 * n_nodes + 1)].view(batch, n_nodes)
    accepted_token_num = out[batch * (2 * n_nodes + 1) :]

    p_ptr = 0 if draft_probs is None else draft_probs.data_ptr()
    q_ptr = target_probs.data_ptr()
    vec = vocab % 4 == 0 and all(ptr % 16 == 0 for ptr in (p_ptr, q_ptr, residual.data_ptr()))
    params = _PARAMS.pack(
        draft_token_ids.data_ptr(),
        draft_token_ids.dtype == torch.int64,
        parents.data_ptr(),
        parents.dtype == torch.int64,
        0 if num_nodes is None else num_nodes.data_ptr(),
        num_nodes is not None and num_nodes.dtype == torch.int64,
        p_ptr,
        q_ptr,
        target_token_ids.data_ptr(),
        target_token_ids.dtype == torch.int64,
        accept_uniforms.data_ptr(),
        recover_uniforms.data_ptr(),
        do_sample.data_ptr(),
        batch,
        n_nodes,
        vocab,
        num_chunks,
        vec,
        output_token_ids.data_ptr(),
        accepted_token_num.data_ptr(),
        accepted_nodes.data_ptr(),
        residual.data_ptr(),
        sums.data_ptr(),
    )
    # A one-element numpy array is passed to the kernel by value: the TsParams struct.
    _kernels(index)[draft_probs is not None](
        (min(batch, MAX_GRID),),
        (THREADS,),
        (np.frombuffer(params, _PARAMS_DTYPE),),
        stream=cupy_stream(stream_ptr, index),
    )
    return output_token_ids, accepted_token_num, accepted_nodes
