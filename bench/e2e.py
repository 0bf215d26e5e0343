"""End-to-end benchmark: both nodes over gRPC on loopback, built-in pair, CPU.

    python bench/e2e.py [--quick]

For K in {0, 1, 2, 4, 8}, greedy and stochastic requests, point-mass and stochastic draft
laws, and concurrency 1 / 8 / 32: generated tokens per second (wall clock, all streams),
the measured mean accept length (emitted tokens per verify step) and the theoretical one,
computed from the exact p and q each verify step used: given the drafts, the expected
emitted count is 1 + sum_i prod_{j<=i} min(1, q_j(d_j) / p_j(d_j)) (p = 1 for point
masses; greedy rows are deterministic). Speed-up = tokens/s at K over K = 0 in the same
run. Writes bench/results/e2e-*.json.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import concurrently, environment, markdown_table, nodes, report
from decode_node.engine import DecodeConfig, DecodeEngine
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from pdspec.client import Client
from prefill_node.engine import PrefillConfig
from sampling import RejectionSampler, Verifier
from sampling.proposal import DraftLaw

KS = [0, 1, 2, 4, 8]
CONCURRENCY = [1, 8, 32]
PROMPTS = ["def main():\n    ", "import ", "class Parser(", "for key, value in ", "    return self.", "# "]


class RecordingSampler:
    """The torch rejection sampler, plus the expected emitted count of every stochastic row."""

    def __init__(self) -> None:
        self.sampler = RejectionSampler("torch")
        self.lock = threading.Lock()
        self.expected: list[float] = []

    def __call__(self, draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample):
        out, emitted = self.sampler(draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample)
        k = draft_ids.shape[1]
        if k:
            q = target_probs[:, :k].gather(-1, draft_ids[..., None].long()).squeeze(-1).double()
            p = (
                torch.ones_like(q)
                if draft_probs is None
                else draft_probs.gather(-1, draft_ids[..., None].long()).squeeze(-1).double()
            )
            ratio = torch.clamp(q / p, max=1.0)
            expected = 1 + ratio.cumprod(-1).sum(-1)
            with self.lock:
                self.expected += expected[do_sample.nonzero().flatten()].tolist()
        return out, emitted

    def take(self) -> list[float]:
        with self.lock:
            out, self.expected = self.expected, []
            return out


def run_load(client: Client, k: int, greedy: bool, concurrency: int, tokens: int, seed0: int) -> dict:
    def worker(i: int) -> tuple[int, int, int]:
        out = client.generate(
            PROMPTS[i % len(PROMPTS)],
            greedy=greedy,
            seed=seed0 + i,
            max_new_tokens=tokens,
            num_speculative_tokens=k,
            timeout=300,
        )
        return len(out.token_ids), out.stats.verify_steps, sum(out.stats.accepted_per_position)

    stats, elapsed = concurrently(worker, concurrency)
    generated = sum(s[0] for s in stats)
    steps = sum(s[1] for s in stats)
    accepted = sum(s[2] for s in stats)
    return {
        "tokens": generated,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
        "verify_steps": steps,
        "accept_length": (accepted + steps) / steps if steps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer tokens per request (smoke run)")
    args = parser.parse_args()
    tokens = {1: 24 if args.quick else 160, 8: 12 if args.quick else 64, 32: 6 if args.quick else 32}
    env = environment()
    pair = load_pair()
    rows, table = [], []
    for law in DraftLaw:
        recorder = RecordingSampler()

        def engine(pair, config, metrics, recorder=recorder):
            return DecodeEngine(pair, config, metrics, verifier=Verifier("torch", sampler=recorder))

        decode, prefill = (
            DecodeConfig(spec=SpeculativeConfig(draft_law=law), max_batch=64),
            PrefillConfig(spec=SpeculativeConfig(draft_law=law)),
        )
        with nodes(pair, decode=decode, prefill=prefill, engine_factory=engine) as (client, _, _):
            for greedy in (True, False):
                for concurrency in CONCURRENCY:
                    base = None
                    for k in KS:
                        recorder.take()
                        result = run_load(client, k, greedy, concurrency, tokens[concurrency], seed0=1000 * k)
                        expected = recorder.take()
                        theory = (sum(expected) / len(expected)) if expected else result["accept_length"]
                        base = base or result["tokens_per_s"]
                        mode = "greedy" if greedy else "stochastic"
                        rows.append(
                            {
                                "law": law.value,
                                "mode": mode,
                                "concurrency": concurrency,
                                "k": k,
                                **result,
                                "accept_length_theory": theory,
                                "speedup_vs_k0": result["tokens_per_s"] / base,
                            }
                        )
                        measured = result["accept_length"]
                        table.append(
                            [
                                law.value,
                                mode,
                                concurrency,
                                k,
                                f"{result['tokens_per_s']:.0f}",
                                f"{result['tokens_per_s'] / base:.2f}x",
                                "-" if measured is None else f"{measured:.2f}",
                                "-" if measured is None else f"{theory:.2f}",
                                result["verify_steps"],
                            ]
                        )
                        print(table[-1], flush=True)
    header = [
        "draft law",
        "requests",
        "concurrency",
        "K",
        "tokens/s",
        "vs K=0",
        "accept length",
        "theory",
        "verify steps",
    ]
    text = markdown_table(header, table)
    report("e2e", env, rows, text)


if __name__ == "__main__":
    main()
