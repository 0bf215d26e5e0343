"""Disaggregated vs colocated PD under a mixed load: does decode keep its pace while long
prompts arrive?

    python bench/pd_gpus.py [--setups disagg,disagg-shm,colocated,k0] [--rates 0.5,1] [--smoke]

Setups, each one run of both nodes (one process each, bench/harness.spawn_nodes) with the
random-weight Llama-3-8B-shaped checkpoint and its 1-layer layer-skip draft:
* disagg: prefill on cuda:0, decode on cuda:1, KV over loopback gRPC (DecodeStream);
* disagg-shm: the same with the KV in shared memory (--kv-transport shm);
* colocated: both nodes on cuda:0, K = 4;
* k0: both nodes on cuda:0, K = 0.
The disaggregated setups need two GPUs and are skipped (said so in the output) with fewer.

Workload per setup and arrival rate, through the gRPC client:
1. `--steady` streams with 128-token prompts decode `--steady-tokens` tokens each, alone: their
   inter-token latency (gap between consecutive stream messages, p50/p99) without prefill load;
2. the same streams again while long requests arrive as a Poisson process at the rate
   (prompts uniform in 128..4096 tokens, 128..512 new tokens, seeded): the steady streams'
   ITL p50/p99 under load, and the arrivals' TTFT p50/p99, ITL p50/p99 and output tokens/s.
The claim under test: under load, decode ITL p99 stays within 1.2x of its no-load value when
prefill has its own GPU, and degrades when it shares decode's.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    Stream,
    bytes_per_token_of,
    environment,
    markdown_table,
    percentile,
    read,
    report,
    serving_client,
    spawn_nodes,
)

SETUPS = {  # name -> (decode device index, prefill device index, K, shared-memory KV)
    "disagg": (1, 0, 4, False),
    "disagg-shm": (1, 0, 4, True),
    "colocated": (0, 0, 4, False),
    "k0": (0, 0, 0, False),
}


def stream(client, prompt: list[int], tokens: int, k: int, seed: int, into: Stream) -> None:
    """One greedy request, read `into` a Stream."""
    call = client.stream(
        prompt_token_ids=prompt, max_new_tokens=tokens, greedy=True, seed=seed, num_speculative_tokens=k, timeout=900
    )
    read(call, into).checked()


def run_phase(client, args, k: int, rate: float | None, vocab: int) -> dict:
    """The steady streams, with Poisson arrivals at `rate` per second beside them (None: alone)."""
    steady = [Stream(time.perf_counter()) for _ in range(args.steady)]
    threads = [
        threading.Thread(target=stream, args=(client, list(range(1, 129)), args.steady_tokens, k, i, steady[i]))
        for i in range(args.steady)
    ]
    arrivals: list[Stream] = []
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    if rate:
        rng = random.Random(f"arrivals-{rate}")
        at = rng.expovariate(rate)
        while at < args.duration:
            time.sleep(max(0.0, start + at - time.perf_counter()))
            prompt = [rng.randrange(1, vocab - 1) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            record = Stream(time.perf_counter())
            arrivals.append(record)
            thread = threading.Thread(
                target=stream, args=(client, prompt, rng.randint(*args.new_tokens), k, 1000 + len(arrivals), record)
            )
            thread.start()
            threads.append(thread)
            at += rng.expovariate(rate)
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    steady_gaps = [until - since for s in steady for since, until, _ in s.gaps()]
    arrival_gaps = [until - since for s in arrivals for since, until, _ in s.gaps()]
    ttfts = [s.ttft for s in arrivals if s.arrivals]
    out = sum(len(s.tokens) for s in steady + arrivals)
    return {
        "rate": rate or 0.0,
        "arrivals": len(arrivals),
        "steady_itl_p50_ms": 1e3 * percentile(steady_gaps, 0.5),
        "steady_itl_p99_ms": 1e3 * percentile(steady_gaps, 0.99),
        "arrival_ttft_p50_ms": None if not ttfts else 1e3 * percentile(ttfts, 0.5),
        "arrival_ttft_p99_ms": None if not ttfts else 1e3 * percentile(ttfts, 0.99),
        "arrival_itl_p50_ms": None if not arrival_gaps else 1e3 * percentile(arrival_gaps, 0.5),
        "arrival_itl_p99_ms": None if not arrival_gaps else 1e3 * percentile(arrival_gaps, 0.99),
        "output_tokens_per_s": out / elapsed,
        "seconds": elapsed,
    }


def run_setup(name: str, args, rows: list[dict], table: list[list]) -> None:
    decode_index, prefill_index, k, shm = SETUPS[name]
    if args.device == "cpu":
        decode_device = prefill_device = "cpu"
    elif max(decode_index, prefill_index) >= torch.cuda.device_count():
        print(f"{name}: skipped, needs {max(decode_index, prefill_index) + 1} GPUs", flush=True)
        rows.append({"setup": name, "skipped": f"needs {max(decode_index, prefill_index) + 1} GPUs"})
        return
    else:
        decode_device, prefill_device = f"cuda:{decode_index}", f"cuda:{prefill_index}"
    per_token = bytes_per_token_of(args.shape) * 33 // 32  # target + the 1-layer draft
    kv_bytes = (args.steady + 24) * (args.max_prompt + 600) * per_token
    port, shutdown, _ = spawn_nodes(args.shape, decode_device, kv_bytes, prefill_device=prefill_device, shm=shm)
    try:
        with serving_client(port) as client:
            vocab = {"smoke": 300}.get(args.shape, 128256)
            warm = Stream(time.perf_counter())
            stream(client, list(range(1, args.max_prompt + 1)), 8, k, 0, warm)  # warm-up: long-prompt path, graphs
            for rate in [None, *args.rates]:
                row = {"setup": name, "decode_device": decode_device, "prefill_device": prefill_device, "k": k}
                row.update(run_phase(client, args, k, rate, vocab))
                rows.append(row)
                fmt = lambda v: "" if v is None else f"{v:.0f}"  # noqa: E731
                table.append(
                    [
                        name,
                        f"{row['rate']:g}",
                        row["arrivals"],
                        fmt(row["steady_itl_p50_ms"]),
                        fmt(row["steady_itl_p99_ms"]),
                        fmt(row["arrival_ttft_p50_ms"]),
                        fmt(row["arrival_ttft_p99_ms"]),
                        fmt(row["arrival_itl_p50_ms"]),
                        fmt(row["arrival_itl_p99_ms"]),
                        f"{row['output_tokens_per_s']:.0f}",
                    ]
                )
                print(table[-1], flush=True)
    finally:
        shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shape, short run (checks the script; CPU is fine)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--setups", default="disagg,disagg-shm,colocated,k0")
    parser.add_argument("--rates", default="0.5,1", help="Poisson arrivals of long requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per phase")
    parser.add_argument("--steady", type=int, default=8, help="decode streams running through each phase")
    parser.add_argument("--steady-tokens", type=int, default=1024)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, nargs=2, default=[128, 512], help="arrivals' new tokens, range")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.shape = "llama3-8b"
    if args.smoke:
        args.shape, args.duration, args.steady, args.steady_tokens = "smoke", 2.0, 2, 24
        args.min_prompt, args.max_prompt, args.rates, args.new_tokens = 8, 64, [2.0], [8, 24]
    env = environment()
    env["gpus"] = str(torch.cuda.device_count())
    rows: list[dict] = []
    table: list[list] = []
    for name in args.setups.split(","):
        run_setup(name, args, rows, table)
    header = [
        "setup",
        "arrivals/s",
        "arrivals",
        "steady ITL p50 ms",
        "steady ITL p99 ms",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "arrival ITL p50 ms",
        "arrival ITL p99 ms",
        "output tokens/s",
    ]
    text = markdown_table(header, table)
    report("pd_gpus", env, rows, text, keep=not args.smoke)


if __name__ == "__main__":
    main()
