"""What speculation buys on the shipped model: every method and K against K = 0, in one run.

    python bench/speedup.py [--device cpu] [--target-model smollm2-135m-instruct] [--draft-layers 8 | --draft-model DIR]
        [--configs k0,draft:4,prompt-lookup:4,prompt-lookup:8,hybrid:4] [--temperatures 0,0.7,1]
        [--batches 1,16] [--max-new-tokens 128] [--prompts bench/prompts/speedup.jsonl]

Both nodes run in this process on loopback, started with the flags a user would give
(`--speculative-method`, adaptive K on for prompt-lookup and hybrid), one pair of nodes per
config. Every prompt of the public set (bench/prompts/speedup.jsonl: summarisation, code
editing, extraction and passage QA — "grounded" — and open chat) goes through the chat
template; batch B runs B streams at once over one class group's prompts (grounded, then chat). Per config, temperature,
batch and prompt class: generated tokens per second of wall time and its ratio to K = 0
measured in the same run, tokens per verify step (accepted drafts + 1), the share of decode
steps that verified drafts, acceptance by position (verify steps accepting draft i), and for
greedy and seeded sampled rows whether every output equals K = 0's token for token (point-mass
proposals are verified by coupling, so a seeded request draws the tokens of K = 0).
Writes bench/results/speedup-*.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import concurrently, environment, markdown_table, method_nodes, report
from models.eagle import is_eagle_dir
from pdspec.client import Client
from pdspec.modelspec import ModelSpec

PROMPTS = Path(__file__).resolve().parent / "prompts" / "speedup.jsonl"
GROUNDED = ("summarise", "code", "extract", "qa")


@dataclass(frozen=True)
class Config:
    method: str  # --speculative-method
    k: int  # the requests' num_speculative_tokens (a cap under adaptive K)

    @property
    def name(self) -> str:
        return "k0" if self.k == 0 else f"{self.method}:{self.k}"

    @classmethod
    def parse(cls, text: str) -> Config:
        if text == "k0":
            return cls("draft", 0)
        method, _, k = text.partition(":")
        return cls(method, int(k or 4))


def run_set(
    client: Client, prompts: list[dict], k: int, temperature: float, batch: int, tokens: int, seeded: bool
) -> list[dict]:
    """Every prompt once, `batch` streams at a time; per prompt its tokens, stats and wall time.
    `seeded`: each sampled request carries a seed of its own (its tokens then never depend on
    what else shares its batch, nor, with point-mass proposals, on K); else none, as from a
    client that sends none."""

    def one(i: int) -> dict:
        prompt = prompts[i]
        started = time.perf_counter()
        out = client.generate(
            prompt_token_ids=prompt["ids"],
            max_new_tokens=tokens,
            greedy=temperature == 0,
            temperature=temperature or 1.0,
            seed=1000 + i if seeded else None,
            num_speculative_tokens=k,
            timeout=600,
        )
        s = out.stats
        return {
            "id": prompt["id"],
            "class": prompt["class"],
            "token_ids": out.token_ids,
            "seconds": time.perf_counter() - started,
            "verify_steps": s.verify_steps,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "accepted_per_position": list(s.accepted_per_position),
            "chosen_k": list(s.chosen_k),
        }

    return concurrently(one, len(prompts), workers=batch)[0]


def diverges_at(tokens: list[int], base: list[int]) -> int | None:
    """The index of the first token where `tokens` differs from `base` (None: equal)."""
    if tokens == base:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, base, strict=False)) if a != b), min(len(tokens), len(base)))


def summarise(rows: list[dict], wall: float) -> dict:
    """One group of prompts, run in `wall` seconds."""
    tokens = sum(len(r["token_ids"]) for r in rows)
    verify = sum(r["verify_steps"] for r in rows)
    steps = sum(sum(r["chosen_k"]) for r in rows)
    accepted = sum(r["accepted_tokens"] for r in rows)
    positions = max((len(r["accepted_per_position"]) for r in rows), default=0)
    by_position = [
        sum(r["accepted_per_position"][i] for r in rows if i < len(r["accepted_per_position"]))
        for i in range(positions)
    ]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "tokens_per_verify": (accepted + verify) / verify if verify else None,
        "verify_share": verify / steps if steps else 0.0,
        "acceptance_by_position": [a / verify for a in by_position] if verify else [],
        "draft_tokens": sum(r["draft_tokens"] for r in rows),
        "accepted_tokens": accepted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--target-model", default="smollm2-135m-instruct")
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument(
        "--draft-model", default=None, help="a draft checkpoint (e.g. `pdspec train-draft`'s) instead of --draft-layers"
    )
    parser.add_argument("--configs", default="k0,draft:4,prompt-lookup:4,prompt-lookup:8,hybrid:4")
    parser.add_argument("--temperatures", default="0,0.7,1")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--limit", type=int, default=0, help="first N prompts of each class (0 = all)")
    parser.add_argument("--name", default="speedup")
    parser.add_argument(
        "--unseeded",
        action="store_true",
        help="sampled requests carry no seed, as from a client that sends none (their outputs are then not "
        "compared with K = 0's); by default each carries its own",
    )
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=4 << 30, help="each node's KV pool (both share the device)"
    )
    args = parser.parse_args()

    configs = [Config.parse(c) for c in args.configs.split(",")]
    if configs[0].k != 0:
        configs.insert(0, Config("draft", 0))
    if args.draft_model and is_eagle_dir(args.draft_model):  # a head serves eagle and hybrid only: K = 0 on eagle
        configs = [Config("eagle", 0) if c.k == 0 else c for c in configs]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    models = ModelSpec(
        target_model=args.target_model,
        draft_model=args.draft_model,
        draft_layers=None if args.draft_model else args.draft_layers,
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
    )
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    tokenizer = models.load().tokenizer
    for p in prompts:
        p["ids"] = tokenizer.encode(tokenizer.apply_chat_template(p["messages"]))
    groups = {}
    for label, classes in (("grounded", GROUNDED), ("chat", ("chat",))):
        chosen = [p for p in prompts if p["class"] in classes]
        if args.limit:
            chosen = [p for c in classes for p in [q for q in chosen if q["class"] == c][: args.limit]]
        if chosen:  # a prompts file may hold one group only
            groups[label] = chosen

    results: dict[tuple, tuple[list[dict], float]] = {}  # (config, T, batch, group) -> (rows, wall seconds)
    by_method: dict[str, list[Config]] = {}
    for config in configs:
        by_method.setdefault(config.method, []).append(config)
    for method, group in by_method.items():
        with method_nodes(models, method, max(batches)) as (client, _, decode):
            print(f"# {method}: step costs {decode.engine.policy.costs}", flush=True)
            # Warm-up, untimed: each group's longest prompt for the whole budget, alone and as many
            # streams as each timed batch, so the CUDA graphs of every key width and batch size a
            # timed run reaches are captured (else the first timed config at a batch pays them).
            longest = [max(chosen, key=lambda p: len(p["ids"])) for chosen in groups.values()]
            for batch in sorted({1, *batches}):
                streams = (longest * batch)[: max(batch, len(longest))]
                run_set(client, streams, group[0].k, 0, batch, args.max_new_tokens, True)
            for config in group:
                for temperature in temperatures:
                    for batch in batches:
                        for label, chosen in groups.items():
                            started = time.perf_counter()
                            rows = run_set(
                                client, chosen, config.k, temperature, batch, args.max_new_tokens, not args.unseeded
                            )
                            wall = time.perf_counter() - started
                            results[(config.name, temperature, batch, label)] = (rows, wall)
                            print(f"{config.name} T={temperature} B={batch} {label}: {wall:.1f}s", flush=True)

    table, out = [], []
    for temperature in temperatures:
        for batch in batches:
            for config in configs:
                for label in groups:
                    rows, wall = results[(config.name, temperature, batch, label)]
                    base, base_wall = results[(configs[0].name, temperature, batch, label)]
                    s, b = summarise(rows, wall), summarise(base, base_wall)
                    same = None
                    if temperature == 0 or not args.unseeded:
                        same = sum(r["token_ids"] == q["token_ids"] for r, q in zip(rows, base, strict=True))
                        for r, q in zip(rows, base, strict=True):  # where an output first leaves K = 0's
                            r["diverges_at"] = diverges_at(r["token_ids"], q["token_ids"])
                    row = {
                        "config": config.name,
                        "temperature": temperature,
                        "batch": batch,
                        "prompts": label,
                        **s,
                        "speedup_vs_k0": s["tokens_per_s"] / b["tokens_per_s"],
                        "identical_to_k0": same,
                        "n": len(rows),
                        "per_prompt": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
                    }
                    out.append(row)
                    table.append(
                        [
                            config.name,
                            temperature,
                            batch,
                            label,
                            f"{s['tokens_per_s']:.1f}",
                            f"{row['speedup_vs_k0']:.2f}x",
                            "-" if s["tokens_per_verify"] is None else f"{s['tokens_per_verify']:.2f}",
                            f"{s['verify_share']:.2f}",
                            " ".join(f"{a:.2f}" for a in s["acceptance_by_position"]),
                            "-" if same is None else f"{same}/{len(rows)}",
                        ]
                    )
    header = ["config", "T", "batch", "prompts", "tok/s", "vs K=0", "tok/verify", "verify share", "acc by pos", "= K=0"]
    text = markdown_table(header, table)
    env = {
        **environment(),
        "device": args.device,
        "target_model": args.target_model,
        "draft": args.draft_model or f"layer-skip {args.draft_layers}",
        "max_new_tokens": str(args.max_new_tokens),
        "sampled_seeds": "none" if args.unseeded else "per request",
    }
    report(args.name, env, out, text)


if __name__ == "__main__":
    main()
