"""The same-host KV handoff: the KV bytes in a POSIX shared-memory segment, a handle on the wire.

The prefill node (`--kv-transport shm`) writes the exported KV into a new file in /dev/shm (a
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
from protos.wire import host_bytes

SHM_DIR = Path("/dev/shm")
_ALIGN = 64  # each tensor starts on a cache line


class SharedKvError(Exception):
    """A segment that cannot be used as its handle says; `violation` is the status to answer."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(str(violation))
        self.violation = violation


class SharedKvSegment:
    """The prefill side: a segment holding one request's KV, its handle, and its unlink."""

    def __init__(self, handle: pdspec_pb2.SharedKv) -> None:
        self.handle = handle
        self.path = SHM_DIR / handle.name

    @classmethod
    def create(cls, kv: Sequence[torch.Tensor]) -> SharedKvSegment:
        """A new segment (owner-only, O_EXCL) with `kv`'s bytes, written and closed: this node keeps
        no mapping, so the pages go as soon as the decode node has imported and unlinked them."""
        handle = pdspec_pb2.SharedKv(name=f"pdspec-kv-{uuid.uuid4().hex}")
        offset = 0
        for tensor in kv:
            handle.manifest.add(data_type=WIRE_DTYPES[tensor.dtype], shape=list(tensor.shape))
            handle.offsets.append(offset)
            handle.lengths.append(tensor.numel() * tensor.element_size())
            offset += -(-handle.lengths[-1] // _ALIGN) * _ALIGN
        handle.size = offset
        segment = cls(handle)
        fd = os.open(segment.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, handle.size)
            for tensor, start in zip(kv, handle.offsets, strict=True):
                view, done = host_bytes(tensor), 0
                while done < len(view):  # one pwrite may write less than asked (2 GiB at most)
                    done += os.pwrite(fd, view[done:], start + done)
        except BaseException:
            segment.unlink()
            raise
        finally:
            os.close(fd)
        return segment

    def unlink(self) -> None:
        """Remove the name (the decode node may have done so already)."""
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
