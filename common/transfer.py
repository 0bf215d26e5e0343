"""Host <-> device copies that do not make the host wait for the device.

A copy from pageable host memory is synchronous: the host waits until the stream has run
everything queued before it, on a decode step a whole forward, and the kernels queued
after the copy then start one launch at a time. Staged through pinned memory the copy is
queued like a kernel and the host goes on queuing the step's work while the forward runs.
torch's pinned-memory cache keeps each staging buffer alive until its copy has run.
The other way (`to_host_async`), a copy into pinned memory on a side stream lets the host
queue more work (the next layers of a forward) while it runs, and wait only where the
bytes are read. `host_bytes` views a tensor's contents as the bytes the wire sends and a KV
import reads (`Buffer`).

A leaf module (it imports nothing of the project's): the samplers' host -> device copies, the
KV import and the engine all go through this one implementation (docs/design.md §1).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Asked once: torch.cuda.is_available() reads the environment and NVML on every call (~7 us,
# about two dozen calls in a speculating step's small copies), and its answer cannot change.
_gpu_present = functools.cache(torch.cuda.is_available)


@functools.cache
def cupy_available() -> bool:
    """Whether CuPy imports: the GPU kernels' launcher (asked once)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


Buffer = bytes | bytearray | memoryview  # host bytes: a payload on the wire, a chunk of KV


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory when a GPU is present (a device tensor, or any tensor
    where no GPU is, as it is)."""
    if tensor.device.type != "cpu" or not _gpu_present() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: "cuda" is the current GPU, which a cache key of device tensors
    must name."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; a host tensor goes to a GPU asynchronously (through pinned memory)."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return pinned(tensor).to(device, non_blocking=True)


def device_tensor(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)` without a host wait on a GPU."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def shared_tensor(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`device_tensor(values, ...)`, one tensor for every call with the same values: a batch's
    per-row constants (which rows are coupled, an index of rows) repeat step after step while
    its rows stay, and then cost no copy. Shared, so never written."""
    return _shared(tuple(values), dtype, indexed(device))


@functools.lru_cache(maxsize=64)
def _shared(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return device_tensor(values, dtype, device)


class Staging:
    """Many small host -> device inputs in ONE copy: each field is a typed view of one device
    buffer (a captured graph's static inputs), written on the host into a mirror of that buffer
    and sent with `send`. The mirrors are pinned (a GPU), so the copy is queued like a kernel and
    no pinned staging buffer is allocated per step. They take turns, and one is written again
    only once the copy from it has run (its event), since the host fills the next inputs while
    the device may still be behind: where the next one's copy is still queued (a draft chain
    replays one graph at every depth of a step, and the host runs a step ahead), another mirror
    joins the ring, up to MIRRORS, so the host waits only beyond that. Fields are laid out in
    order, each at a multiple of ALIGN bytes."""

    ALIGN = 16
    MIRRORS = 16

    def __init__(self, fields: Sequence[tuple[str, tuple[int, ...], torch.dtype]], device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._layout, end = [], 0
        for name, shape, dtype in fields:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self._layout.append((name, shape, dtype, end, size))
            end += -(-size // self.ALIGN) * self.ALIGN
        self.nbytes = end
        self._buffer = torch.zeros(end, dtype=torch.uint8, device=self.device)
        self.fields = self._views(self._buffer)  # on the device: what the consumer reads
        # made as needed: a graph never replayed pins nothing
        self._mirrors: list[torch.Tensor] = []
        self._host: list[dict[str, np.ndarray]] = []
        self._sent: list[torch.cuda.Event | None] = []
        self._next = 0

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: buffer[at : at + size].view(dtype).view(shape) for name, shape, dtype, at, size in self._layout}

    def host(self) -> dict[str, np.ndarray]:
        """The next mirror's fields (numpy views of it) to write this step's inputs into."""
        sent = self._sent[self._next] if self._mirrors else None
        if not self._mirrors or (sent is not None and not sent.query() and len(self._mirrors) < self.MIRRORS):
            mirror = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._mirrors.insert(self._next, mirror)
            self._host.insert(self._next, {name: v.numpy() for name, v in self._views(mirror).items()})
            self._sent.insert(self._next, None)
        elif sent is not None:
            sent.synchronize()  # every mirror's copy still queued: the device is MIRRORS copies behind
        return self._host[self._next]

    def send(self) -> None:
        """The mirror `host` returned, copied to the device fields (queued on the current
        stream: work queued after this reads the new values)."""
        self._buffer.copy_(self._mirrors[self._next], non_blocking=True)
        if self.device.type == "cuda":
            event = self._sent[self._next] or torch.cuda.Event()
            event.record()
            self._sent[self._next] = event
        self._next = (self._next + 1) % len(self._mirrors)


@dataclass(frozen=True)
class HostCopy:
    """A tensor on its way to the host: `wait()` returns the host tensor once it is there."""

    host: torch.Tensor
    done: torch.cuda.Event | None = None  # None: already on the host
    device: torch.device | None = None  # the GPU the copy runs on

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            # The waiting thread (gRPC's) may have no device set: without this, the runtime
            # would give it a context on GPU 0 whatever GPU the copy runs on.
            with torch.cuda.device(self.device):
                self.done.synchronize()  # a blocking event: the thread sleeps, the GIL released
        return self.host


# Pinned bytes of exports not yet read (a sender slower than the forward would otherwise pin a
# whole prompt's KV per request, and torch's pinned cache keeps what it has pinned): beyond
# this an export is a plain synchronous copy to pageable memory.
PINNED_EXPORT_BYTES = 1 << 30
_pinned = [0]
_PINNED_LOCK = threading.Lock()


def _unpin(nbytes: int) -> None:
    with _PINNED_LOCK:
        _pinned[0] -= nbytes


_SIDE_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """The process's one stream for `purpose` ("kv-import", "kv-export", "tokens") on a GPU: copies
    queued there overlap the compute stream's kernels."""
    with _SIDE_STREAMS_LOCK:
        key = (device, purpose)
        if key not in _SIDE_STREAMS:
            _SIDE_STREAMS[key] = torch.cuda.Stream(device)
        return _SIDE_STREAMS[key]


def to_host_async(tensor: torch.Tensor, limit: int = PINNED_EXPORT_BYTES, purpose: str = "kv-export") -> HostCopy:
    """`tensor` copied to pinned host memory on a side stream (`purpose`'s), after the work queued
    so far on the current stream: the host does not wait here, and the kernels queued after this
    do not wait for the copy. A host tensor is returned as it is. While `limit` bytes of such
    copies are unread, the copy is synchronous instead (pageable memory; the host waits)."""
    if tensor.device.type != "cuda":
        return HostCopy(tensor.cpu())
    nbytes = tensor.numel() * tensor.element_size()
    with _PINNED_LOCK:
        pinned = _pinned[0] + nbytes <= limit
        if pinned:
            _pinned[0] += nbytes
    if not pinned:
        return HostCopy(tensor.cpu())
    stream = side_stream(tensor.device, purpose)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    # Counted while its HostCopy holds it: the sender drops that once every slice is serialized.
    weakref.finalize(host, _unpin, nbytes)
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record(stream)
    tensor.record_stream(stream)  # its memory is not reused before the copy has read it
    return HostCopy(host, done, tensor.device)


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A read-only byte view of `tensor`'s C-order contents; a copy only when it is not a
    contiguous CPU tensor (a GPU tensor lands in pinned host memory)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(t)
        t = host
    elif not t.is_contiguous():
        t = t.contiguous()
    if not t.numel():
        return memoryview(b"")
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16: view the bytes first
        t = t.reshape(-1).view(torch.uint8)
    return memoryview(t.numpy()).cast("B").toreadonly()  # C order: the cast flattens it
