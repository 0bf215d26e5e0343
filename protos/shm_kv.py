"""The same-host KV handoff: the KV bytes in a POSIX shared-memory segment, a handle on the wire.

The prefill node (`--kv-transport shm`) exports the KV straight into a new file in /dev/shm (a
tmpfs both nodes see: one host, or containers sharing /dev/shm) and sends only
`DecodeRequest.kv_shm` (name, size, each tensor's declaration, offset and length). A decode node
started with `--accept-shm-kv` checks the handle (protos/validation.py: name pattern, lengths
against the declared shapes, ranges inside the declared size), opens the segment read-only,
checks its real size against the declared one, maps it as it is (nothing is allocated from a
claimed size), unlinks it and imports the KV from the mapping. The prefill node unlinks it too
when the call ends, however it ended (refused, failed, a decode node that died), so no segment
outlives the call that made it.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from protos import pdspec_pb2
from protos.codec import WIRE_DTYPES
from protos.validation import SHM_NAME, Code, Violation

SHM_DIR = Path("/dev/shm")
_ALIGN = 64  # each tensor starts on a cache line


class SharedKvError(Exception):
    """A segment that cannot be used as its handle says; `violation` is the status to answer."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(str(violation))
        self.violation = violation


class SharedKvSegment:
    """The prefill side: a new segment sized for one request's KV and mapped here; the export
    writes straight into `tensors` (views of it), so the segment is the KV, not a copy of it.
    `close()` then drops this node's mapping: the bytes stay in the file, and its pages go once
    the decode node has imported and unlinked it."""

    def __init__(self, handle: pdspec_pb2.SharedKv, mapping: mmap.mmap, tensors: list[torch.Tensor]) -> None:
        self.handle = handle
        self.path = SHM_DIR / handle.name
        self.tensors = tensors
        self._mapping = mapping

    @classmethod
    def create(cls, tensors: Sequence[tuple[torch.dtype, Sequence[int]]]) -> SharedKvSegment:
        """An owner-only file (O_EXCL) in SHM_DIR for tensors of these dtypes and shapes."""
        handle = pdspec_pb2.SharedKv(name=f"pdspec-kv-{uuid.uuid4().hex}")
        offset = 0
        for dtype, shape in tensors:
            handle.manifest.add(data_type=WIRE_DTYPES[dtype], shape=list(shape))
            handle.offsets.append(offset)
            handle.lengths.append(math.prod(shape) * dtype.itemsize)
            offset += -(-handle.lengths[-1] // _ALIGN) * _ALIGN
        handle.size = offset
        path = SHM_DIR / handle.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, handle.size)
            mapping = mmap.mmap(fd, handle.size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        views = [
            torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape), offset=start).view(*shape)
            for (dtype, shape), start in zip(tensors, handle.offsets, strict=True)
        ]
        return cls(handle, mapping, views)

    def close(self) -> None:
        """Unmap (every view of `tensors` must be gone: BufferError otherwise)."""
        self.tensors = []
        self._mapping.close()

    def unlink(self) -> None:
        """Remove the name (the decode node may have done so already); the pages go once no
        process maps them."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@contextlib.contextmanager
def mapped(handle: pdspec_pb2.SharedKv) -> Iterator[memoryview]:
    """The decode side: the segment of a validated handle, read-only, its name unlinked once it is
    mapped (the pages stay until the mapping closes). SharedKvError when it is missing (the
    nodes do not share /dev/shm: FAILED_PRECONDITION), not a regular file or not of its declared
    size (INVALID_ARGUMENT)."""
    if not SHM_NAME.fullmatch(handle.name):  # validated already; never open another name
        raise SharedKvError(Violation("kv_shm.name", "'pdspec-kv-' and 32 lowercase hex digits", repr(handle.name)))
    path = SHM_DIR / handle.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SharedKvError(
            Violation(
                "kv_shm.name",
                f"a segment in {SHM_DIR} of this host (the nodes must share /dev/shm)",
                f"no {path}",
                Code.FAILED_PRECONDITION,
            )
        ) from None
    except OSError as err:
        raise SharedKvError(Violation("kv_shm.name", "a regular file in /dev/shm", f"{path}: {err}")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SharedKvError(Violation("kv_shm.name", "a regular file in /dev/shm", f"mode {info.st_mode:o}"))
        if info.st_size != handle.size:
            raise SharedKvError(Violation("kv_shm.size", f"{info.st_size} (the segment's size)", str(handle.size)))
        mapping = mmap.mmap(fd, handle.size, prot=mmap.PROT_READ) if handle.size else None
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    if mapping is None:
        yield memoryview(b"")
        return
    try:
        yield memoryview(mapping)
    finally:
        with contextlib.suppress(BufferError):  # a view kept by a traceback: it closes when that goes
            mapping.close()
