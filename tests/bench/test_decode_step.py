"""bench/decode_step.py on the CPU, tiny: a held batch (the gate's verdict fixed to hold) emits
one token a row per step, and every row reports the collector's time per step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_held_rows_run_at_k0_and_every_row_reports_the_collector(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(ROOT / "bench/decode_step.py"), "--smoke", "--device", "cpu"]
    command += ["--method", "prompt-lookup", "--batches", "2", "--k", "0,2", "--scheduling", "on,held", "--freeze"]
    done = subprocess.run([*command, "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((r["k"], r["async_scheduling"]) for r in rows) == [(0, "held"), (0, "on"), (2, "held"), (2, "on")]
    for row in rows:
        assert row["frozen"] and row["gc_ms_per_step"] >= 0 and row["gc_collections_per_step"] >= 0
        if row["async_scheduling"] == "held":
            assert row["tokens_per_row_step"] == 1.0
