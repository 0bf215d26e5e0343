"""Host cost per row of a decode step's bookkeeping outside the forward, on the CPU.

    python bench/host_work.py [--root DIR] [--repeat 7]

Two per-row costs of every speculating step on the engine thread, each timed alone (median of
`--repeat` runs, one torch thread), for this checkout or another one (`--root`, a baseline commit
in a worktree; run both, alternating, to compare):
* prompt lookup: a row's context grows by 3 tokens (its step emitted them), then two matches
  with drafts after the context (what a row drafting ahead asks: the guess, then its drafts),
  on a 300-token context of 50 distinct tokens;
* metrics: one verified row recorded on a node's Prometheus series (verify step, source, chosen
  K), 4 drafts of which 2 accepted.
Writes bench/results/host_work[-baseline]-*.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ROWS = 2000  # row-steps per run


def lookup_us(context_index) -> float:
    rng = random.Random(0)
    tokens = [rng.randrange(50) for _ in range(300)]
    index = context_index(tokens, 2, 5)
    index.match(4)
    emitted = [[rng.randrange(50) for _ in range(3)] for _ in range(ROWS)]

    def steps() -> None:
        for new in emitted:
            tokens.extend(new)
            index.match(4, [1, 2, 3, 4])
            index.match(4, [1, 2, 3, 4, 5])

    return timeit.timeit(steps, number=1) / ROWS * 1e6


def metrics_us(node_metrics) -> float:
    metrics = node_metrics("decode", 4, methods=["prompt-lookup"], sources=["prompt-lookup"])
    chosen = getattr(metrics, "record_chosen", None) or (lambda m, d: metrics.chosen_k.labels(m).observe(d))

    def rows() -> None:
        for _ in range(ROWS):
            metrics.record_step(False, 4, 2, 3)
            metrics.record_source("prompt-lookup", 4, 2)
            chosen("prompt-lookup", 4)

    return timeit.timeit(rows, number=1) / ROWS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(HERE))
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import torch

    from bench.harness import environment, markdown_table, report  # this checkout's: it imports no engine

    sys.path.insert(0, args.root)
    from engine.prompt_lookup import ContextIndex  # the --root checkout's
    from pdspec.metrics import NodeMetrics

    torch.set_num_threads(1)
    found = {"prompt_lookup_us": [], "metrics_us": []}
    for _ in range(args.repeat):
        found["prompt_lookup_us"].append(lookup_us(ContextIndex))
        found["metrics_us"].append(metrics_us(NodeMetrics))
    rows = {name: statistics.median(times) for name, times in found.items()}
    env = environment()
    env["root"] = args.root
    table = [[name.removesuffix("_us"), f"{us:.1f}"] for name, us in rows.items()]
    text = markdown_table(["per row and step", "µs (median)"], table)
    report("host_work" if Path(args.root).resolve() == HERE else "host_work-baseline", env, rows, text)


if __name__ == "__main__":
    main()
