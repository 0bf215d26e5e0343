"""bench/api_speedup.py end to end on the CPU: `pdspec serve` with the built-in pair in its own
processes, the official openai client, default against K = 0 alternated; the rows it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_reports_every_group_both_settings_and_identical_greedy_text(tmp_path):
    out = tmp_path / "rows.json"
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("def fibonacci(n):", "import os\n")))
    command = [sys.executable, str(ROOT / "bench/api_speedup.py"), "--smoke", "--batches", "1,2"]
    command += ["--temperatures", "0", "--rounds", "2", "--prompts", str(prompts), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["group"], r["batch"]) for r in rows] == [("mine", 1), ("mine", 2)]
    for row in rows:
        assert row["tokens_per_s_default"] > 0 and row["tokens_per_s_k0"] > 0
        assert row["ratio_steady"] > 0 and row["ttft_max"] > 0
        left, right = row["identical"].split("/")
        assert left == right and int(right) >= 2  # greedy: the same text with and without speculation


def test_a_spent_budget_reports_the_cells_that_ran(tmp_path):
    out = tmp_path / "rows.json"
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": "def fibonacci(n):"}) + "\n")
    command = [sys.executable, str(ROOT / "bench/api_speedup.py"), "--smoke", "--batches", "1,2", "--temperatures", "0"]
    command += ["--rounds", "2", "--budget", "0", "--prompts", str(prompts), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1]  # the first cell only, whole: both settings, both rounds
    assert rows[0]["tokens_per_s_default"] > 0 and rows[0]["tokens_per_s_k0"] > 0
    assert "budget spent: T=0.0 B=2 mine" in done.stdout
