"""The process's heap in use by glibc's count (a small copy of bench/harness.py's: tests do not import bench)."""

from __future__ import annotations

import ctypes
from typing import ClassVar


class _MallInfo2(ctypes.Structure):
    _fields_: ClassVar = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _mallinfo2():
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_in_use() -> int | None:
    """Bytes the process has allocated and not freed (every malloc: torch, numpy, gRPC, Python
    alike), or None without glibc's mallinfo2. Unlike RSS it does not count memory freed but
    kept by the allocator."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd
