"""First-use stalls of a fresh prefill engine, by prompt length.

    python bench/first_use.py [--device cuda] [--shape smollm2-135m | --target-model GGUF|DIR]
                              [--lengths 1-69,70-519:7] [--profile] [--smoke]

A prefill engine built as `pdspec serve` builds the prefill node's (the model on its KV pool,
its kernels compiled and its graphs captured at start-up: `paged_pair`), then, for each length,
one prompt of that length prefilled twice (different tokens): the first call meets whatever
that length uses for the first time (a compile, an autotune, a library's per-shape plan, an
allocator growth), the second is the steady cost. A length whose first call takes over
3x the second plus 20 ms is a stall. Per stall: the torch.compile graphs compiled meanwhile
(dynamo's counters), and with `--profile` the host operators that took the most time in that
first call (torch.profiler around every first call: what the stall is spent in). Kernels the
driver JIT-compiles on first use stall only where its cache does not hold them yet: run with
`CUDA_CACHE_PATH=$(mktemp -d)` to see a fresh machine's (`make gpu-check`'s first-use step does).
Writes bench/results/first_use-*.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, random_model, random_pair, report, sync
from engine.paged_lm import paged_pair
from engine.spec_config import SpeculativeConfig
from pdspec.modelspec import ModelSpec
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2

STALL_FACTOR, STALL_MS = 3.0, 20.0


def lengths_of(text: str) -> list[int]:
    """ "1-69,70-519:7" -> 1..69, then 70..519 in steps of 7."""
    out: list[int] = []
    for part in text.split(","):
        span, _, step = part.partition(":")
        low, _, high = span.partition("-")
        out.extend(range(int(low), int(high or low) + 1, int(step or 1)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="smollm2-135m", help="random weights of this shape (bench/harness.SHAPES)")
    parser.add_argument("--target-model", default=None, help="a real checkpoint instead of --shape")
    parser.add_argument("--draft-layers", type=int, default=8, help="the launcher's layer-skip draft")
    parser.add_argument("--lengths", default=None, help="default 1-69,70-519:7 (--smoke: 1,2,17,33)")
    parser.add_argument("--profile", action="store_true", help="profile every first call (slower)")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, nothing kept")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.draft_layers = "smoke", 1
    lengths = lengths_of(args.lengths or ("1,2,17,33" if args.smoke else "1-69,70-519:7"))
    device = args.device
    spec = ModelSpec(target_model=args.target_model, draft_layers=args.draft_layers, device=device)
    started = time.perf_counter()
    loaded = spec.load() if args.target_model else random_pair(random_model(args.shape, device), args.draft_layers)
    pair = paged_pair(loaded, 1 << 30, capture=spec.graph_capture(max_k=4, decode=False))
    startup = time.perf_counter() - started
    engine = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(method="prompt-lookup")))
    vocab = pair.target.vocab_size
    from torch._dynamo.utils import counters

    def prefill(length: int, salt: int, profiled: bool) -> tuple[float, list[list]]:
        request = pdspec_pb2.GenerateRequest(
            prompt_token_ids=[(31 * j + salt) % (vocab - 10) + 5 for j in range(length)],
            sampling=pdspec_pb2.SamplingParams(max_new_tokens=8),
            num_speculative_tokens=4,
        )
        checked = engine.check(request)
        sync(device)
        if not profiled:
            began = time.perf_counter()
            engine.prefill_many([checked])
            sync(device)
            return time.perf_counter() - began, []
        from torch.profiler import profile

        with profile() as prof:
            began = time.perf_counter()
            engine.prefill_many([checked])
            sync(device)
            took = time.perf_counter() - began
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
        return took, [[e.key[:80], round(e.self_cpu_time_total / 1e3, 2)] for e in ops]

    rows = []
    for length in lengths:
        before = dict(counters["stats"])
        first, ops = prefill(length, 1, args.profile)
        again, _ = prefill(length, 2, False)
        compiled = {k: v - before.get(k, 0) for k, v in counters["stats"].items() if v != before.get(k, 0)}
        stall = first * 1e3 > STALL_FACTOR * again * 1e3 + STALL_MS
        rows.append(
            {
                "length": length,
                "first_ms": first * 1e3,
                "again_ms": again * 1e3,
                "stall": stall,
                "dynamo": compiled,
                "first_call_top_ops_ms": ops if stall else [],
            }
        )
    stalls = [r for r in rows if r["stall"]]
    table = markdown_table(
        ["length", "first ms", "again ms", "dynamo", "first call's top host ops (ms)"],
        [
            [r["length"], f"{r['first_ms']:.0f}", f"{r['again_ms']:.1f}", r["dynamo"] or "", r["first_call_top_ops_ms"]]
            for r in stalls
        ],
    )
    text = f"start-up {startup:.1f} s; {len(stalls)} of {len(rows)} lengths stall\n{table}"
    env = environment()
    env.update(device=device, shape=args.target_model or args.shape)
    found = {"startup_s": startup, "rows": rows, "jit_cache": os.environ.get("CUDA_CACHE_PATH")}
    report("first_use", env, found, text, keep=not args.smoke, json_path=args.json)


if __name__ == "__main__":
    main()
