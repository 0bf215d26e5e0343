"""bench/gpu_check.py in its --smoke mode on the CPU: the steps asked for run, each under its
budget, the others are recorded as skipped; the speedup step runs this tree and a baseline
tree (here the same one) and compares them; one step that overruns its budget is killed and
the check fails; the results file names the machine, the versions, the commit, the date and
the command line. The script runs as its own process (tests do not import bench/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
STEPS = [
    "kernel-tests",
    "engine-tests",
    "eagle-tests",
    "first-use",
    "speedup",
    "acceptance",
    "e2e",
    "serve-tests",
    "api",
]


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """One smoke run: speedup against a baseline, acceptance and the API; serve-tests with a
    budget too short for pytest to start; the rest not asked for."""
    out = tmp_path_factory.mktemp("gpu-check")
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)]
    command += ["--only", "speedup,acceptance,serve-tests,api", "--budget", "serve-tests=1"]
    command += ["--baseline-tree", str(ROOT), "--api-variant", "ahead:PDSPEC_DECODE_SPECULATE_AHEAD=on"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the test workers, not spinning against them
    # a node flag's default the results file must name (no effect: async scheduling is off on a
    # CPU), and a secret it must not
    env |= {"PDSPEC_DECODE_SPECULATE_AHEAD": "on", "PDSPEC_BENCH_SECRET": "hunter2"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, env=env)
    (results,) = out.glob("gpu-check-cpu-*.json")
    return done, json.loads(results.read_text()), results


def test_the_results_file_names_the_machine_versions_commit_date_and_command(check):
    _, results, path = check
    env = results["environment"]
    for key in ("date", "commit", "command", "python", "torch", "grpcio", "protobuf", "transformers"):
        assert env[key], key
    assert env["cpu"] and int(env["cpu_cores"]) >= 1
    assert "gpu" not in env and env["device"] == "cpu"
    assert path.name == f"gpu-check-cpu-{env['date'][:10]}-{env['commit']}.json"
    assert "gpu_check.py" in env["command"] and "--smoke" in env["command"]
    # the PDSPEC_* variables the nodes ran under (`pdspec serve` passes them on), no secret
    assert "PDSPEC_DECODE_SPECULATE_AHEAD=on" in env["command"].split() and "hunter2" not in env["command"]
    assert path.with_suffix(".log").read_text().count("=====") == 5  # two speedup runs, acceptance, serve-tests, api


def test_each_step_is_run_skipped_or_killed_at_its_budget(check):
    done, results, _ = check
    steps = {s["step"]: s for s in results["rows"]["steps"]}
    assert list(steps) == STEPS
    for name in ("kernel-tests", "engine-tests", "eagle-tests", "first-use", "e2e"):
        assert steps[name]["status"] == "skipped" and "--only" in steps[name]["reason"]
    assert steps["acceptance"]["status"] == "passed", steps["acceptance"].get("output_tail")
    assert steps["serve-tests"]["status"] == "timeout" and steps["serve-tests"]["seconds"] < 10
    assert steps["serve-tests"]["budget_s"] == 1 and steps["acceptance"]["budget_s"] > 1
    assert results["rows"]["passed"] is False and done.returncode == 1
    rows = steps["acceptance"]["figures"]["rows"]
    assert [r["k"] for r in rows] == [0, 4] and all(r["outputs_equal_k0"] for r in rows)
    assert steps["api"]["status"] == "passed", steps["api"].get("output_tail")
    (run,) = steps["api"]["figures"]["runs"]  # one --api-variant: its nodes under its variables
    assert run["label"] == "ahead" and run["variables"] == {"PDSPEC_DECODE_SPECULATE_AHEAD": "on"}
    api = run["rows"]
    assert [r["batch"] for r in api if r["group"] == "chat"] == [1, 2]
    assert all(r["tokens_per_s_default"] > 0 and r["tokens_per_s_k0"] > 0 for r in api)


def test_speedup_runs_both_trees_and_compares_them(check):
    _, results, _ = check
    speedup = next(s for s in results["rows"]["steps"] if s["step"] == "speedup")
    assert speedup["status"] == "passed", speedup.get("output_tail")
    figures = speedup["figures"]
    assert [r["tree"] for r in figures["runs"]] == ["this", "baseline"]
    assert all(r["status"] == "passed" and r["rows"] for r in figures["runs"])
    comparison = figures["comparison"]
    assert {(c["config"], c["prompts"]) for c in comparison} == {
        (config, prompts) for config in ("k0", "prompt-lookup:4") for prompts in ("grounded", "chat")
    }
    for row in comparison:
        assert row["temperature"] == 0 and row["same_steps"] is True  # one tree twice: the same greedy steps
        assert set(row["speedup_vs_k0"]) == {"this", "baseline"} and row["speedup_ratio"] > 0


def test_the_first_use_step_runs_with_an_empty_driver_jit_cache(tmp_path):
    """A kernel the driver JIT-compiles on first use stalls only where its cache is empty: the
    step gives its process an empty cache of its own, as a fresh machine has."""
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_CACHE_PATH": str(tmp_path / "the-callers")}
    done = subprocess.run([*command, "--only", "first-use"], capture_output=True, text=True, timeout=300, env=env)
    (results,) = tmp_path.glob("gpu-check-cpu-*.json")
    step = next(s for s in json.loads(results.read_text())["rows"]["steps"] if s["step"] == "first-use")
    assert step["status"] == "passed" and done.returncode == 0, step.get("output_tail")
    cache = Path(step["figures"]["jit_cache"])
    assert cache.name.startswith("jit-cache-") and cache != tmp_path / "the-callers"


@pytest.mark.parametrize("variant", ["ahead", "ahead:SPECULATE_AHEAD=on", "ahead:PDSPEC_X", "a-b:PDSPEC_X=1"])
def test_a_malformed_api_variant_is_the_parsers_error(variant):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--only", "api", "--api-variant", variant],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--api-variant" in done.stderr and repr(variant) in done.stderr
