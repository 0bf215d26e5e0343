"""bench/http_stream.py end to end on the CPU: `pdspec serve --builtin` started from a given
tree, a plain httpx client streaming over kept-alive and fresh connections; the rows it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_reports_both_connection_kinds_of_the_tree(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(ROOT / "bench/http_stream.py"), "--smoke", "--tree", str(ROOT), "--json", str(out)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    kinds = ["first request", "kept-alive", "fresh"]
    assert [(r["tree"], r["connection"]) for r in rows] == [(str(ROOT), kind) for kind in kinds]
    for row in rows:
        assert 0 < row["first_chunk_ms"] <= row["last_chunk_ms"]
        assert row["node_latency_ms"] > 0  # the node counted the requests: its metrics moved
