"""Torch reference rejection sampler on the CPU vs the per-row Python loop baseline.

    python bench/sampling_cpu.py

Prints a table and writes bench/results/sampling_cpu-*.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, median_time, report
from bench.kernel import make_inputs
from sampling import rejection_sample
from sampling.naive import rejection_sample_loop

CASES = [(1, 4, 32000), (16, 4, 32000), (64, 4, 128256)]


def main() -> None:
    env = environment()
    rows, table = [], []
    for batch, k, vocab in CASES:
        for dense in (True, False):
            # All-stochastic rows with a real rejection rate: the residual pass is exercised.
            args = make_inputs(batch, k, vocab, dense, device="cpu")
            ref_ms = 1e3 * median_time(lambda a=args: rejection_sample(*a, backend="torch"))
            loop_ms = 1e3 * median_time(lambda a=args: rejection_sample_loop(*a), warmup=1, repeat=5)
            mode = "dense" if dense else "point mass"
            rows.append(
                {
                    "batch": batch,
                    "k": k,
                    "vocab": vocab,
                    "mode": mode,
                    "reference_ms": ref_ms,
                    "loop_baseline_ms": loop_ms,
                }
            )
            table.append(
                [f"({batch}, {k}, {vocab})", mode, f"{ref_ms:.3f}", f"{loop_ms:.3f}", f"{loop_ms / ref_ms:.1f}x"]
            )
    text = markdown_table(["(B, K, V)", "draft", "torch reference ms", "per-row loop ms", "speed-up"], table)
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    report("sampling_cpu", env, rows, text)


if __name__ == "__main__":
    main()
