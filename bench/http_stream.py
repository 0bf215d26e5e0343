"""How a streamed OpenAI API response reaches a client, chunk by chunk, on fresh and kept-alive
connections.

    python bench/http_stream.py [--tree DIR ...] [--requests 12] [--max-new-tokens 32]
        [--serve-flag=--x=y ...] [--device cpu] [--smoke] [--json FILE]

Both nodes start as `pdspec serve --builtin` starts them (the built-in pair: its steps take
about a millisecond, so what is measured is the HTTP path, not the model), once per `--tree`
(a checkout; default: this one), from that tree's code. A plain `httpx` client streams
`/v1/completions` (greedy, `stream: true`) `--requests` times over one kept-alive connection,
then as many times on a fresh connection each, after the first request of the fresh nodes
(reported apart: what first use costs). Per tree and connection kind (medians): the time to
the first `data:` line, to the last, and the time the node itself reports for the request
(`pdspec_request_latency_seconds` over the requests). A response whose chunks were held back
arrives in one burst near its end: first ≈ last. Writes bench/results/http_stream-*.json
(`--smoke`: 2 requests each, nothing kept).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import LOOPBACK, environment, markdown_table, report, scrape, served, served_arguments

PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown fox"
LATENCY = "pdspec_request_latency_seconds"


def stream_once(client, url: str, model: str, tokens: int) -> tuple[float, float]:
    """(seconds to the first data line, to the last) of one streamed completion."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    started, first, last = time.perf_counter(), None, None
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:"):
                last = time.perf_counter() - started
                first = last if first is None else first
    return first, last


def node_latency(metrics_port: int) -> tuple[float, float]:
    """(requests ended, their summed latency) on the prefill node."""
    samples = scrape(metrics_port)
    count = sum(v for (name, _), v in samples.items() if name == f"{LATENCY}_count")
    total = sum(v for (name, _), v in samples.items() if name == f"{LATENCY}_sum")
    return count, total


def measure(tree: Path | None, args: argparse.Namespace) -> list[dict]:
    import httpx

    rows = []
    with served(args.device, ["--builtin", *args.serve_flag], args.start_timeout, tree) as nodes:
        base = f"http://{LOOPBACK}:{nodes.http}/v1"
        with httpx.Client(timeout=60) as kept:
            model = kept.get(f"{base}/models").json()["data"][0]["id"]
            count, total = node_latency(nodes.ports["prefill-metrics"])
            first = stream_once(kept, f"{base}/completions", model, args.max_new_tokens)  # first use of the nodes
            rows.append(row(tree, "first request", [first], nodes.ports["prefill-metrics"], count, total))
            for kind in ("kept-alive", "fresh"):
                count, total = node_latency(nodes.ports["prefill-metrics"])
                times = []
                for _ in range(args.requests):
                    if kind == "kept-alive":
                        times.append(stream_once(kept, f"{base}/completions", model, args.max_new_tokens))
                    else:
                        with httpx.Client(timeout=60) as fresh:
                            times.append(stream_once(fresh, f"{base}/completions", model, args.max_new_tokens))
                rows.append(row(tree, kind, times, nodes.ports["prefill-metrics"], count, total))
    return rows


def row(tree: Path | None, kind: str, times: list[tuple[float, float]], port: int, count: float, total: float) -> dict:
    """The medians of `times`, and the node's mean latency of the requests it ended since it had
    ended `count` of `total` seconds."""
    ended, summed = node_latency(port)
    return {
        "tree": str(tree or "."),
        "connection": kind,
        "first_chunk_ms": 1e3 * statistics.median(f for f, _ in times),
        "last_chunk_ms": 1e3 * statistics.median(last for _, last in times),
        "node_latency_ms": 1e3 * (summed - total) / max(1.0, ended - count),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    served_arguments(parser, start_timeout=120.0)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="2 requests each, nothing kept")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.smoke:
        args.requests = 2
    if args.requests < 1 or args.max_new_tokens < 2:
        parser.error("--requests: expected >= 1; --max-new-tokens: expected >= 2")
    rows = []
    for tree in args.tree or [None]:
        rows += measure(tree.resolve() if tree else None, args)
    figures = ("first_chunk_ms", "last_chunk_ms", "node_latency_ms")
    table = markdown_table(
        ["tree", "connection", "first chunk ms", "last chunk ms", "node's latency ms"],
        [[r["tree"], r["connection"], *(f"{r[k]:.1f}" for k in figures)] for r in rows],
    )
    env = environment()
    env["trees"] = ", ".join(str(t) for t in args.tree or ["."])
    report("http_stream", env, rows, table, keep=not args.smoke, json_path=args.json)


if __name__ == "__main__":
    main()
