"""bench/verify_layouts.py in its --smoke mode: both layouts of a ragged point-mass batch run
and emit the same tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "verify_layouts.py"


def test_the_smoke_run_times_both_layouts_and_they_agree():
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| 4 | 64 |" in done.stdout and done.stdout.rstrip().endswith("| yes |")
