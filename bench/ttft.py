"""Time to first token under concurrency, both nodes in one process on loopback, one tree
against another in the same run.

    python bench/ttft.py --tree . --tree /path/to/another/checkout [--rounds 3]

Each round runs every tree in turn (A B A B ...), each in a fresh worker process: that tree's
own bench/ttft.py, importing that tree's code (so a tree older than this script's harness is
measured too, by its own copy of this worker): the nodes serve `--target-model` with a `--draft-layers` draft (the
`--method` proposer), and N clients (`--concurrency`, 1,8,32) send a P-token prompt each
(`--prompt-tokens`; distinct random ids, seeded) at once, for 2 new tokens. Per stream: the
time to the first token (the prefill node's own) and to the second (the decode node's first,
after the proposal and the KV handoff). Medians over streams, then the median over rounds.
Writes bench/results/ttft-*.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    """One tree's measurements, as JSON on stdout (runs with that tree first on sys.path)."""
    import random

    import torch

    from bench.harness import concurrently, method_nodes, read
    from pdspec.modelspec import ModelSpec

    torch.manual_seed(0)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    models = ModelSpec(
        target_model=args.target_model, draft_layers=args.draft_layers, kv_cache_bytes=args.kv_cache_bytes
    )
    out = {}
    with method_nodes(models, args.method, max(concurrency)) as (client, _, decode):
        vocab = decode.engine.pair.target.vocab_size
        rng = random.Random(args.seed)

        def burst(n: int) -> list[tuple[float, float]]:
            """n streams started together: each one's (first, second) token times in seconds."""
            prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(n)]
            barrier = threading.Barrier(n)

            def one(i: int) -> tuple[float, float]:
                barrier.wait()
                ids = prompts[i]
                call = client.stream(
                    prompt_token_ids=ids, max_new_tokens=2, greedy=True, num_speculative_tokens=args.k, timeout=600
                )
                first, second = read(call).checked().token_times()
                return first, second

            return concurrently(one, n)[0]

        burst(max(concurrency))  # warm-up, untimed
        for n in concurrency:
            times = burst(n)
            out[n] = {
                "ttft_ms": statistics.median(t[0] for t in times) * 1e3,
                "second_token_ms": statistics.median(t[1] for t in times) * 1e3,
            }
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to measure (repeat; default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target-model", default="smollm2-135m-instruct")
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--method", default="draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path[0] = str(HERE)  # this tree, not bench/ (whose models.py would shadow models/)
        worker(args)
        return

    sys.path.insert(0, str(HERE))
    from bench.harness import commit, environment, markdown_table, write_results

    trees = [t.resolve() for t in args.tree or [HERE]]
    passed = [a for a in sys.argv[1:] if a not in {"--tree", *map(str, args.tree or [])}]
    runs: dict[Path, list[dict]] = {tree: [] for tree in trees}
    for round_ in range(args.rounds):
        for tree in trees:
            command = [sys.executable, str(tree / "bench" / "ttft.py"), "--worker", *passed]
            done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"round {round_ + 1} {tree}: {runs[tree][-1]}", flush=True)

    env = environment()
    names = {tree: commit(tree) for tree in trees}
    env["trees"] = {str(tree): name for tree, name in names.items()}
    rows, table = [], []
    for n in args.concurrency.split(","):
        row = {"concurrency": int(n)}
        for tree in trees:
            for figure in ("ttft_ms", "second_token_ms"):
                row[f"{names[tree]} {figure}"] = statistics.median(r[n][figure] for r in runs[tree])
        rows.append(row)
        cells = [n]
        for tree in trees:
            cells += [f"{row[f'{names[tree]} ttft_ms']:.0f}", f"{row[f'{names[tree]} second_token_ms']:.0f}"]
        table.append(cells)
    header = ["streams"] + [f"{names[t]} {f}" for t in trees for f in ("TTFT ms", "2nd token ms")]
    text = markdown_table(header, table)
    print(text)
    print(write_results("ttft", env, {"args": vars(args) | {"tree": [str(t) for t in trees]}, "rows": rows}, text))


if __name__ == "__main__":
    main()
