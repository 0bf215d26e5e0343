"""bench/acceptance.py's oracle drafts at the acceptance rate it is given: a greedy request's
tokens are the K = 0 ones, the per-draft acceptance is within a binomial bound of α (a run at
another α fails it), α = 1 accepts every draft and α = 0 none. The script runs as its own
process on the tiny random Llama (tests do not import bench/), and reports its rows as JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "acceptance.py"
ALPHAS = (0.0, 0.3, 0.7, 1.0)
K, BATCH, NEW_TOKENS = 4, 4, 64
SIGMAS = 4.5


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[float | None, dict]:
    """The run's rows by α (None: K = 0)."""
    out = tmp_path_factory.mktemp("acceptance") / "rows.json"
    command = [sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--alphas", ",".join(map(str, ALPHAS))]
    command += ["--ks", str(K), "--batches", str(BATCH), "--new-tokens", str(NEW_TOKENS), "--seed", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the test workers, not spinning against them
    done = subprocess.run([*command, "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {row["alpha"]: row for row in json.loads(out.read_text())}


def agrees(accepted: int, reached: int, alpha: float) -> bool:
    """Whether accepted of reached Bernoulli(alpha) draws is within SIGMAS standard deviations."""
    return abs(accepted / reached - alpha) <= SIGMAS * math.sqrt(alpha * (1 - alpha) / reached)


def test_greedy_outputs_equal_k0_token_for_token(rows):
    assert set(rows) == {None, *ALPHAS}
    for row in rows.values():
        assert row["outputs_equal_k0"] and row["requests_equal_to_k0"] == BATCH, row
    assert rows[0.7]["verify_steps"] > 0 and rows[0.7]["accepted_drafts"] > 0


def test_per_draft_acceptance_is_within_a_binomial_bound_of_alpha(rows):
    row = rows[0.7]
    assert row["reached_drafts"] >= 200  # enough draws that another α is told apart
    assert agrees(row["accepted_drafts"], row["reached_drafts"], 0.7)
    biased = rows[0.3]  # drafts right 30% of the time, claimed to be right 70% of it
    assert agrees(biased["accepted_drafts"], biased["reached_drafts"], 0.3)
    assert not agrees(biased["accepted_drafts"], biased["reached_drafts"], 0.7)
    assert all(r["acceptance_within_bound"] for r in rows.values() if r["k"])
    expected = 0.7 + 0.7**2 + 0.7**3 + 0.7**4
    assert row["expected_accepted_per_step"] == pytest.approx(expected)


def test_alpha_one_accepts_every_draft_and_alpha_zero_none(rows):
    one, zero = rows[1.0], rows[0.0]
    assert one["verify_steps"] > 0 and zero["verify_steps"] > 0
    assert one["accepted_drafts"] == one["draft_tokens"] == K * one["verify_steps"]
    assert one["accepted_per_step"] == K and one["per_draft_acceptance"] == 1.0
    assert zero["draft_tokens"] == K * zero["verify_steps"] and zero["accepted_drafts"] == 0
    assert zero["reached_drafts"] == zero["verify_steps"]  # only the first draft of each step is verified
