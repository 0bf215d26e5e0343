"""Full garbage collections of running nodes, at start-up and under concurrent load.

    python bench/gc_pauses.py [--tree DIR ...] [--streams 16] [--seconds 90] [--max-new-tokens 48]
        [--serve-flag=--x=y ...] [--device cpu] [--smoke] [--json FILE]

Both nodes start as `pdspec serve` starts them (SmolLM2 unless `--serve-flag` says otherwise),
once per `--tree` (a checkout; default: this one), from that tree's code. Each of its
processes (the launcher and the nodes) carries a hook (a `sitecustomize` put first on its
path, which then imports the one it shadows) that records every collection of the oldest
generation, a full collection, with its duration: the pause of every thread of the process.
`--streams` clients then send greedy completions back to back for `--seconds`. Per tree:
the full collections before the load (start-up) and during it (count, total and longest
pause), the requests completed and the tokens per second. Writes
bench/results/gc_pauses-*.json (`--smoke`: 2 streams for 5 s, nothing kept).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LOOPBACK, environment, markdown_table, report, served, served_arguments

# Runs first in every node process: appends "pid wall-clock end duration-ms" per full collection
# to $PDSPEC_GC_TRACE, then imports the sitecustomize it shadows (a GPU image may have one).
HOOK = """
import gc, importlib, os, sys, time

_trace = os.environ.get("PDSPEC_GC_TRACE")
if _trace:
    _started = [0.0]

    def _collected(phase, info):
        if phase == "start":
            _started[0] = time.perf_counter()
        elif info["generation"] == 2:
            with open(_trace, "a") as out:
                out.write(f"{os.getpid()} {time.time():.6f} {(time.perf_counter() - _started[0]) * 1e3:.3f}\\n")

    gc.callbacks.append(_collected)

_here = os.path.dirname(os.path.abspath(__file__))
_self = sys.modules.pop("sitecustomize")
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
try:
    importlib.import_module("sitecustomize")
except ImportError:
    pass
finally:
    sys.path[:] = _path
    sys.modules["sitecustomize"] = _self
"""
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story {}:"


def load(port: int, model: str, streams: int, seconds: float, tokens: int) -> tuple[int, int]:
    """(requests completed, tokens generated) by `streams` clients sending completions back
    to back for `seconds` (at least one each)."""
    import httpx

    url = f"http://{LOOPBACK}:{port}/v1/completions"
    stop = time.monotonic() + seconds
    done = [[0, 0] for _ in range(streams)]
    failed: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with httpx.Client(timeout=300) as session:
                while True:  # at least one request each
                    body = {"model": model, "prompt": PROMPT.format(f"{i}.{done[i][0]}"), "max_tokens": tokens}
                    answer = session.post(url, json={**body, "temperature": 0})
                    answer.raise_for_status()
                    done[i][0] += 1
                    done[i][1] += answer.json()["usage"]["completion_tokens"]
                    if time.monotonic() >= stop:
                        break
        except BaseException as err:  # the run is void: say why
            failed.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise SystemExit(f"a client failed: {failed[0]!r}")
    return sum(d[0] for d in done), sum(d[1] for d in done)


def pauses(trace: Path, after: float, before: float) -> list[float]:
    """The full collections' pauses (ms) of the served processes that ended in (after, before]."""
    if not trace.exists():
        return []
    out = []
    for line in trace.read_text().splitlines():
        _, ended, ms = line.split()
        if after < float(ended) <= before:
            out.append(float(ms))
    return out


def measure(tree: Path | None, args: argparse.Namespace) -> dict:
    import httpx

    with tempfile.TemporaryDirectory() as hook:
        (Path(hook) / "sitecustomize.py").write_text(HOOK)
        trace = Path(hook) / "trace"
        env = {"PYTHONPATH": hook, "PDSPEC_GC_TRACE": str(trace)}
        with served(args.device, args.serve_flag, args.start_timeout, tree, env) as nodes:
            model = httpx.get(f"http://{LOOPBACK}:{nodes.http}/v1/models").json()["data"][0]["id"]
            load(nodes.http, model, 1, 0.0, 2)  # one request: the decode peer is up
            started = time.time()
            requests, tokens = load(nodes.http, model, args.streams, args.seconds, args.max_new_tokens)
            ended = time.time()
        under = pauses(trace, started, ended)
        start_up = pauses(trace, 0.0, started)
    return {
        "tree": str(tree or "."),
        "start_up_full_collections": len(start_up),
        "start_up_pause_ms": sum(start_up),
        "full_collections": len(under),
        "pause_ms": sum(under),
        "longest_pause_ms": max(under, default=0.0),
        "requests": requests,
        "tokens_per_s": tokens / (ended - started),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    served_arguments(parser, start_timeout=300.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--smoke", action="store_true", help="2 streams for 5 s, nothing kept")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.seconds = 2, 5.0
    if args.streams < 1 or args.seconds <= 0 or args.max_new_tokens < 1:
        parser.error("--streams: expected >= 1; --seconds: expected > 0; --max-new-tokens: expected >= 1")
    rows = [measure(tree.resolve() if tree else None, args) for tree in args.tree or [None]]
    table = markdown_table(
        ["tree", "start-up: full collections / ms", "under load: full collections", "pause ms", "longest ms", "tok/s"],
        [
            [
                r["tree"],
                f"{r['start_up_full_collections']} / {r['start_up_pause_ms']:.0f}",
                r["full_collections"],
                f"{r['pause_ms']:.0f}",
                f"{r['longest_pause_ms']:.0f}",
                f"{r['tokens_per_s']:.1f}",
            ]
            for r in rows
        ],
    )
    env = environment()
    env["trees"] = ", ".join(str(t) for t in args.tree or ["."])
    env["load"] = f"{args.streams} streams, {args.seconds:.0f} s, {args.max_new_tokens} tokens a request"
    report("gc_pauses", env, rows, table, keep=not args.smoke, json_path=args.json)


if __name__ == "__main__":
    main()
