"""bench/first_use.py in its --smoke mode on the CPU: a fresh prefill engine prefills every
length asked for (single values, ranges and stepped ranges) twice and reports the stalls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "first_use.py"


def test_the_smoke_run_prefills_every_length_and_reports_the_stalls():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--lengths", "3,10-20:5,30-31"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "of 6 lengths stall" in done.stdout and "| length | first ms |" in done.stdout
