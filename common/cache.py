"""pdspec's on-disk cache of derived artefacts (the built-in pair's tables, a GGUF file's
converted tokenizer): `PDSPEC_CACHE_DIR`, else ~/.cache/pdspec. Entries are keyed by a digest
of their source and published atomically, so processes starting at once (both nodes, test
workers) never read a half-written one; whichever finishes first wins."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("PDSPEC_CACHE_DIR", Path.home() / ".cache" / "pdspec"))


def publish_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory `tmp` to `final`; if another process published `final`
    meanwhile, keep theirs and drop `tmp`."""
    try:
        tmp.rename(final)
    except OSError:  # final exists (not empty): another process was first
        shutil.rmtree(tmp, ignore_errors=True)
