"""Shared benchmark plumbing: environment facts, timing, and result files."""

from __future__ import annotations

import collections
import ctypes
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, str]:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # PDSPEC_COMMIT names the commit where the tree was copied without .git (the GPU machine).
        "commit": os.environ.get("PDSPEC_COMMIT")
        or _git("rev-parse", "--short", "HEAD") + ("-dirty" if _git("status", "--porcelain") else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cpu_threads": str(torch.get_num_threads()),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = str(torch.version.cuda or torch.version.hip)
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except ImportError:
        pass
    return env


def gil_holders(pid: int, seconds: int, rate: int = 250, top: int = 20) -> dict:
    """Who holds process `pid`'s GIL (py-spy's --gil sampling for `seconds`): the share of the
    nominal seconds x rate samples in which any thread held it (low if py-spy fell behind), and
    the functions (inclusive) those samples were in, as a share of them. Needs the py-spy
    executable (pip install py-spy) and the right to ptrace `pid`."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("py-spy: expected on PATH (pip install py-spy), got none")
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        cmd = [spy, "record", "--gil", "--nonblocking", "-f", "raw", "-r", str(rate), "-d", str(seconds)]
        done = subprocess.run([*cmd, "-p", str(pid), "-o", out.name], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"py-spy on pid {pid}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
        lines = Path(out.name).read_text().splitlines()
    held, inclusive = 0, collections.Counter()
    for line in lines:
        stack, count = line.rsplit(" ", 1)
        held += int(count)
        for frame in {re.sub(r":\d+\)$", ")", f) for f in stack.split(";")}:  # each function once per sample
            inclusive[frame] += int(count)
    return {
        "gil_held": held / (seconds * rate),
        "functions": [(frame, n / held) for frame, n in inclusive.most_common(top)] if held else [],
    }


def median_ms(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 15, sync: Callable[[], None] = lambda: None):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def write_results(name: str, env: dict[str, str], rows: list[dict] | dict, table: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = env.get("gpu", "cpu").replace(" ", "-")
    path = RESULTS / f"{name}-{tag}-{env['date'][:10]}-{env['commit']}.json"  # one file per run
    path.write_text(json.dumps({"environment": env, "rows": rows, "table": table}, indent=2) + "\n")
    return path


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
    """Bytes the process has allocated and not freed, by glibc's count (every malloc: torch,
    numpy, gRPC, Python alike), or None without glibc's mallinfo2. Unlike RSS it does not
    count memory freed but kept by the allocator."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=RESULTS.parent.parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
