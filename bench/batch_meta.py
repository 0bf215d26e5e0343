"""Host cost of one forward's paged-attention metadata (engine/kv_cache.batch_meta).

    python bench/batch_meta.py [--root DIR]

Built on the host before every forward (eager, or the refill of a CUDA graph's static inputs),
so it sits on the decode step's critical path: a K = 4 step builds it five times (four draft
depths and the verify pass). Min over 5 repeats of 200 calls, one torch thread; `--root` times
another checkout's batch_meta (a baseline commit in a worktree) with the same shapes.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SHAPES = ((1, 1, 256), (8, 1, 256), (8, 5, 256), (16, 5, 512), (64, 1, 512))  # rows, queries per row, context


def best_us(call) -> float:
    return min(timeit.repeat(call, number=200, repeat=5)) / 200 * 1e6


def measure(pool, paged_seq, batch_meta, rows: int, queries: int, context: int) -> tuple[float, float]:
    """(eager µs, graph-refill µs) for `rows` sequences of `context` tokens, `queries` new each."""
    seqs = []
    for _ in range(rows):
        seq = paged_seq()
        pool.reserve(seq, context + queries)
        seq.length = context
        seqs.append(seq)
    lengths, bucket = [queries] * rows, 1 << max(0, rows - 1).bit_length()
    eager = best_us(lambda: batch_meta(pool, seqs, lengths, None))
    graph = best_us(lambda: batch_meta(pool, seqs, lengths, None, rows=bucket, width=1024))
    for seq in seqs:
        pool.release(seq)
    return eager, graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(HERE))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import torch

    from bench.harness import environment, markdown_table, report  # this checkout's: it imports no engine

    sys.path.insert(0, args.root)
    from engine.kv_cache import KvPool, PagedSeq, batch_meta  # the --root checkout's

    torch.set_num_threads(1)
    pool = KvPool(layers=1, kv_heads=1, head_dim=8, num_blocks=4096, block_size=16, dtype=torch.float32, device="cpu")
    rows, table = [], []
    for batch, queries, context in SHAPES:
        eager, graph = measure(pool, PagedSeq, batch_meta, batch, queries, context)
        rows.append({"rows": batch, "queries": queries, "context": context, "eager_us": eager, "graph_us": graph})
        table.append([batch, queries, context, f"{eager:.0f}", f"{graph:.0f}"])
        print(table[-1], flush=True)
    env = environment()
    env["root"] = args.root
    text = markdown_table(["rows", "queries per row", "context", "eager µs", "graph refill µs"], table)
    report("batch_meta" if Path(args.root).resolve() == HERE else "batch_meta-baseline", env, rows, text)


if __name__ == "__main__":
    main()
