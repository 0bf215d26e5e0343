"""CUDA graphs captured at start-up vs on first use (`--graph-capture-*`, engine/paged_lm.py).

    python bench/graph_capture.py [--device cuda] [--shape llama3-8b] [--batches 1,8,32] [--smoke]

The random-weight checkpoint with its 1-layer layer-skip draft on paged pools, as the decode
node puts them (`paged_pair`). Measured:
* the start-up capture of the decode node's default GraphCapture (rows up to 32, key widths up
  to 2048, decode steps and K = 4 verify passes, the draft's one- and two-token depths):
  seconds, graphs, and the GPU memory it allocates beyond the KV pools;
* per batch and queries per row (1: a decode step, 5: a K = 4 verify pass), the first forward
  of that shape on rows of 256 context tokens when its graph is captured on first use (what a
  request meets without the start-up capture), the same first forward on the pair that
  captured at start-up, and the steady forward (median of later ones).
Writes bench/results/graph_capture-*.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    environment,
    markdown_table,
    median_time,
    prefilled_rows,
    random_model,
    random_pair,
    report,
    sync,
)
from engine.paged_lm import bytes_per_token, paged_pair
from pdspec.modelspec import ModelSpec


def forwards(lm, batch: int, queries: int, context: int, device: str, repeat: int) -> tuple[float, float]:
    """(seconds of the first forward of this shape, median seconds of the next `repeat`)."""
    with prefilled_rows(lm, batch, context, queries) as one:
        sync(device)
        started = time.perf_counter()
        one()
        sync(device)
        first = time.perf_counter() - started
        return first, median_time(one, repeat, warmup=1, device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, two batches")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.batches = "smoke", "1,2"
    device, batches = args.device, [int(b) for b in args.batches.split(",")]
    target = random_model(args.shape, device)
    raw = random_pair(target)
    kv_bytes = 16 * 4096 * (bytes_per_token(raw.target) + bytes_per_token(raw.draft))
    capture = ModelSpec().graph_capture(max_k=8, decode=True, max_batch=32)  # the decode node's default
    lazy = paged_pair(raw, kv_bytes)
    gpu = torch.device(device).type == "cuda"
    before = torch.cuda.memory_allocated() if gpu else 0
    started = time.perf_counter()
    captured = paged_pair(raw, kv_bytes, capture=capture)
    sync(device)
    seconds = time.perf_counter() - started
    pool_bytes = captured.target.pool.kv.nbytes + captured.draft.pool.kv.nbytes  # allocated with the pair
    extra = (torch.cuda.memory_allocated() - before - pool_bytes) / 2**20 if gpu else 0.0
    graphs = len(captured.target._graphs) + len(captured.draft._graphs)
    startup = {
        "capture": repr(capture),
        "seconds": seconds,  # pools + warm-up + the capture
        "graphs": graphs,
        "allocated_mib": extra,  # the graphs' static inputs, outputs and what their pool keeps
    }
    print(startup, flush=True)
    rows, table = [], []
    for batch in batches:
        for queries in (1, 5):
            first_lazy, steady = forwards(lazy.target, batch, queries, args.context, device, args.repeat)
            first_captured, _ = forwards(captured.target, batch, queries, args.context, device, args.repeat)
            row = {
                "batch": batch,
                "queries": queries,
                "first_on_first_use_ms": first_lazy * 1e3,
                "first_after_startup_capture_ms": first_captured * 1e3,
                "steady_ms": steady * 1e3,
            }
            rows.append(row)
            table.append(
                [
                    batch,
                    queries,
                    f"{first_lazy * 1e3:.1f}",
                    f"{first_captured * 1e3:.2f}",
                    f"{steady * 1e3:.2f}",
                ]
            )
            print(table[-1], flush=True)
    header = [
        "batch",
        "queries per row",
        "first forward, captured on first use ms",
        "first forward, captured at start-up ms",
        "steady ms",
    ]
    memory = f"{startup['allocated_mib']:.0f} MiB allocated"
    text = (
        f"start-up capture ({args.shape}): {graphs} graphs in {seconds:.1f} s (pools, warm-up and capture), "
        f"{memory} beyond the KV pools (GPU)\n\n" + markdown_table(header, table)
    )
    report("graph_capture", environment(), {"startup": startup, "forwards": rows}, text)


if __name__ == "__main__":
    main()
