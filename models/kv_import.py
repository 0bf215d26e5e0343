"""KV between a model's own storage and the wire layout, both ways: the one conversion.

Export is `gather`: the live slots of a storage as a wire tensor. Import goes a chunk at a
time: wire bytes written straight into the storage (`KvWriter`).

A KV tensor on the wire is `[kv_heads, seq, head_dim]` in C order, so any byte range of it is a
run of (head, position) rows of `head_dim` elements that may start and end inside a row (a
chunk size need not be a multiple of a row). A model keeps position p of every head in a slot:
`storage [slots, kv_heads, head_dim]` (a layer of the paged pool, or a contiguous cache seen that
way) and `slots[p]`. `KvWriter.write` maps the range onto that: the whole rows of one head are
ONE scatter, a partial row is a byte copy; nothing the size of the KV is allocated.

On the CPU the scatter is numpy fancy assignment into a view of the storage (about 3 GB/s for
256-byte rows on a 2-core CPU, where torch's `index_copy_` on uint8 rows does 0.4 GB/s).
On a GPU each chunk makes one host -> device copy: into a reusable pinned buffer, one
non-blocking copy to a device staging buffer, then the scatter as one kernel, all on one import
stream per device (the engine's stream never waits on an upload). The import stream does wait,
once, for what the compute stream has queued when the import begins: its slots may belong to a
request that left while a step with it was still on the device. `wait()` blocks until they are
done; the model calls it before the KV is used or its storage freed, which orders every copy
before the engine's first use of the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from common.transfer import Buffer, host_bytes, side_stream
from protos.kv_layout import KvTensorSpec

STAGING_BYTES = 4 << 20  # a GPU import's pinned and device staging buffers: the default --kv-chunk-bytes


def gather(storage: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Wire tensor [kv_heads, n, head_dim] of the positions whose slots are `slots` ([n] int64,
    on the storage's device) in `storage` [slots, kv_heads, head_dim]; not C-contiguous."""
    return storage.index_select(0, slots).transpose(0, 1)


class KvWriter:
    """Writes the wire bytes of one request's KV tensors into their storage."""

    def __init__(
        self, layout: Sequence[KvTensorSpec], seq: int, storages: Sequence[torch.Tensor], slots: torch.Tensor
    ) -> None:
        """`storages[i]`: where tensor i's positions live, [slots, kv_heads, head_dim] of its dtype
        (a view of the model's memory); `slots`: [seq] int64 host tensor, the slot of each position."""
        if len(storages) != len(layout) or len(slots) != seq:
            raise ValueError(
                f"storages/slots: expected {len(layout)} storages and {seq} slots, got {len(storages)}/{len(slots)}"
            )
        self.shapes = [spec.shape_for(seq) for spec in layout]
        self.sizes = [spec.nbytes(seq) for spec in layout]
        self.rows = [shape[2] * spec.dtype.itemsize for shape, spec in zip(self.shapes, layout, strict=True)]
        for i, (storage, spec, shape) in enumerate(zip(storages, layout, self.shapes, strict=True)):
            if storage.dtype != spec.dtype or tuple(storage.shape[1:]) != (shape[0], shape[2]):
                expected = f"{spec.dtype} [slots, {shape[0]}, {shape[2]}]"
                raise ValueError(f"storages[{i}]: expected {expected}, got {storage.dtype} {list(storage.shape)}")
        self.device = storages[0].device if storages else torch.device("cpu")
        self.gpu = self.device.type != "cpu"
        self._slots = slots.numpy()  # the slot of a partial row, read on the host
        if self.gpu:
            self.stream = side_stream(self.device, "kv-import")
            # The slots may have been freed a moment ago by a request whose work is still queued on
            # the compute stream (a step in flight, a KV move): this import's writes follow it.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):  # the allocator ties what the import uses to its stream
                self._index = slots.to(self.device)
            self._dest = [s.view(torch.uint8) for s in storages]  # [slots, kv_heads, row bytes]
            self._staging = min(STAGING_BYTES, sum(self.sizes))
            self._pinned: torch.Tensor | None = None
            self._staged: torch.Tensor | None = None
            self._copied: torch.cuda.Event | None = None
        else:
            self._index = self._slots
            self._dest = [s.view(torch.uint8).numpy() for s in storages]

    def write(self, index: int, offset: int, data: Buffer | torch.Tensor) -> None:
        """Bytes [offset, offset + len) of KV tensor `index`; a tensor stands for its C-order bytes."""
        if not 0 <= index < len(self.sizes):
            raise ValueError(f"index: expected a KV tensor in 0..{len(self.sizes) - 1}, got {index}")
        device_tensor = isinstance(data, torch.Tensor) and data.device.type != "cpu"
        if device_tensor:
            src = data.detach().contiguous().view(-1).view(torch.uint8)
        else:
            src = np.frombuffer(host_bytes(data) if isinstance(data, torch.Tensor) else data, dtype=np.uint8)
        size = self.sizes[index]
        if offset < 0 or offset + len(src) > size:
            raise ValueError(
                f"data: expected at most {max(size - offset, 0)} bytes at offset {offset} of KV tensor {index} "
                f"({size} bytes), got {len(src)}"
            )
        if not len(src):
            return
        if not self.gpu:
            self._scatter(index, offset, src)
        elif device_tensor:  # already on the device: the import stream waits for its producer
            self.stream.wait_stream(torch.cuda.current_stream(src.device))
            src.record_stream(self.stream)
            self._scatter(index, offset, src)
        else:
            for start in range(0, len(src), self._staging):
                self._scatter(index, offset + start, self._stage(src[start : start + self._staging]))

    def _stage(self, piece: np.ndarray) -> torch.Tensor:
        """`piece` on the device: pinned buffer, then one non-blocking copy on the import stream."""
        n = len(piece)
        if self._pinned is None:
            self._pinned = torch.empty(self._staging, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(self.stream):
                self._staged = torch.empty(self._staging, dtype=torch.uint8, device=self.device)
        elif self._copied is not None:
            self._copied.synchronize()  # the previous chunk has left the pinned buffer
        self._pinned[:n].numpy()[:] = piece
        with torch.cuda.stream(self.stream):
            self._staged[:n].copy_(self._pinned[:n], non_blocking=True)  # later scatters follow on this stream
            self._copied = torch.cuda.Event()
            self._copied.record(self.stream)
        return self._staged[:n]

    def _scatter(self, index: int, offset: int, src) -> None:
        """src (numpy or device uint8) = bytes [offset, offset + len(src)) of tensor `index`."""
        _, seq, _ = self.shapes[index]
        row, dest = self.rows[index], self._dest[index]
        pos, end = offset, offset + len(src)
        with torch.cuda.stream(self.stream) if self.gpu else contextlib.nullcontext():
            while pos < end:
                r, within = divmod(pos, row)
                head, position = divmod(r, seq)
                at = pos - offset
                if within or end - pos < row:  # a row split between chunks: its bytes in this one
                    take = min(row - within, end - pos)
                    dest[int(self._slots[position]), head, within : within + take] = src[at : at + take]
                else:  # whole rows of one head
                    rows = min((end - pos) // row, seq - position)
                    take = rows * row
                    dest[self._index[position : position + rows], head] = src[at : at + take].reshape(rows, row)
                pos += take

    def wait(self) -> None:
        """Block until every copy of this import is done and drop its staging buffers."""
        if self.gpu:
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()
            self._pinned = self._staged = self._copied = None
