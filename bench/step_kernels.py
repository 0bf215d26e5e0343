"""Where one forward of the 8B shape spends its device time, by attention backend.

    python bench/step_kernels.py [--batches 1,32] [--queries 1,5] [--context 256] [--shape llama3-8b]

For each attention backend (the Triton kernel, gather + SDPA) and each (batch, queries per
row): rows of `--context` tokens are prefilled, then the forward of `queries` new tokens per
row is run through its CUDA graph. Reported per forward:
* kernels and their summed device time (torch.profiler), the top kernels by time;
* the graph replay alone, timed with CUDA events over 50 replays: the device's time for the
  forward, launch gaps between its kernels included, no host work;
* the wall time of the whole `extend_batch` (bench/harness.step_rows: host metadata, the
  inputs' copies, the replay, the logits' copy, a synchronize), as the engine-step table measures.
The difference between the last two is the host's share of a step. Writes
bench/results/step_kernels-*.json.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    copy_bandwidth,
    environment,
    markdown_table,
    paged,
    prefilled_rows,
    random_model,
    report,
    step_rows,
    weight_bytes,
)


def forward_kernels(lm, batch: int, queries: int, context: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with prefilled_rows(lm, batch, context, queries) as one:
        for _ in range(3):
            one()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                one()
            torch.cuda.synchronize()
        (graph,) = [g for (rows, q, _), g in lm._graphs.items() if rows == batch and q == queries]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(50):
            graph.graph.replay()
        end.record()
        end.synchronize()
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name][0] += 1
            by_name[event.name][1] += event.device_time / 5 / 1e3  # ms per forward
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:8]
    return {
        "kernels": sum(n for n, _ in by_name.values()) / 5,
        "kernel_ms": sum(t for _, t in by_name.values()),
        "replay_ms": begin.elapsed_time(end) / 50,
        "top": [[name[:90], n / 5, t] for name, (n, t) in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--queries", default="1,5")
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    env = environment()
    bandwidth = copy_bandwidth("cuda")
    env["copy_bandwidth_GBps"] = f"{bandwidth / 1e9:.0f}"
    model = random_model(args.shape, "cuda")
    floor = weight_bytes(model) / bandwidth
    rows, table = [], []
    for attention in ("triton", "sdpa"):
        lm = paged(model, 64 * (args.context + 16), attention)
        for batch in (int(b) for b in args.batches.split(",")):
            for queries in (int(q) for q in args.queries.split(",")):
                row = forward_kernels(lm, batch, queries, args.context)
                row["wall_ms"] = step_rows(lm, batch, args.context, queries, "cuda", 20) * 1e3
                row.update(attention=attention, batch=batch, queries=queries, floor_ms=floor * 1e3)
                rows.append(row)
                table.append(
                    [
                        attention,
                        batch,
                        queries,
                        f"{row['kernels']:.0f}",
                        f"{row['kernel_ms']:.2f}",
                        f"{row['replay_ms']:.2f} ({floor * 1e3 / row['replay_ms']:.0%} of floor)",
                        f"{row['wall_ms']:.2f} ({floor * 1e3 / row['wall_ms']:.0%})",
                    ]
                )
                print(table[-1], flush=True)
        del lm
    header = ["attention", "batch", "queries/row", "kernels", "kernel ms", "graph replay ms", "step wall ms"]
    text = markdown_table(header, table)
    report("step_kernels", env, rows, text)


if __name__ == "__main__":
    main()
