"""bench/gc_pauses.py end to end on the CPU: `pdspec serve --builtin` with the collection hook in
its processes, two clients for a few seconds; the row it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_sees_each_node_freeze_its_start_up_and_counts_the_load(tmp_path):
    out = tmp_path / "rows.json"
    command = [
        sys.executable,
        str(ROOT / "bench/gc_pauses.py"),
        "--smoke",
        "--serve-flag=--builtin",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    # each node collects everything once before it freezes what is left (pdspec.serving.freeze_start_up)
    assert row["start_up_full_collections"] >= 2
    assert row["start_up_pause_ms"] > 0
    assert row["requests"] >= 2 and row["tokens_per_s"] > 0  # both clients' requests, at least one each
