"""Speculation as users meet it: running nodes, the OpenAI API, default against K = 0.

    python bench/api_speedup.py [--device cpu|cuda] [--batches 1,16,64] [--temperatures 0,0.7]
        [--max-new-tokens 128] [--rounds 3] [--prompts bench/prompts/speedup.jsonl ...]
        [--serve-flag=--speculative-method=hybrid ...] [--budget SECONDS] [--smoke]

Both nodes start as a user starts them (`pdspec serve`, the launcher's default flags plus any
`--serve-flag`), in their own processes, and every request goes through the official `openai`
client to the prefill node's HTTP API, streamed. Each request is sent twice on the same running
nodes: with the server's default speculation, and with `num_speculative_tokens: 0`, the two
alternated round by round (round r runs the default first when r is even), so neither pays the
first use of a shape or warms the other's. Batch B runs B streams at once, every request of a
round with the same setting. Per prompt group, temperature and batch: generated tokens per
second of wall time for both and their ratio, TTFT (median, worst), and whether the texts are
identical (greedy, and seeded at T > 0: point-mass proposals are verified by coupling, so a
seeded request draws K = 0's tokens). The first round on fresh nodes is reported apart from the
steady state (the rounds after it); `first/steady` is the worst request's latency in the first
round over the median of the same prompt's later requests (a first-use stall shows there).

Prompt groups: the `class` of each JSONL line (bench/prompts/speedup.jsonl: summarise, code,
extract, qa — "grounded" — and chat; bench/prompts/complete.jsonl: code completion), or a
user's JSONL of {"messages": [...]} or {"prompt": "..."} lines (group: its file name).
Writes bench/results/api_speedup-*.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, percentile, report, served

PROMPTS = [Path(__file__).resolve().parent / "prompts" / name for name in ("speedup.jsonl", "complete.jsonl")]
GROUNDED = ("summarise", "code", "extract", "qa")
SETTINGS = ("default", "k0")


@dataclass(frozen=True)
class Prompt:
    id: str
    group: str
    messages: list[dict] | None = None
    text: str | None = None


@dataclass
class Outcome:
    prompt: str
    group: str
    setting: str
    round: int
    temperature: float
    batch: int
    latency: float
    ttft: float
    tokens: int
    text: str


@dataclass
class Cell:
    """One (group, temperature, batch): every round's wall time and tokens per setting."""

    walls: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SETTINGS})
    tokens: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in SETTINGS})


def load_prompts(paths: list[Path], completions: bool = False) -> list[Prompt]:
    """Every prompt of the JSONL files; `completions`: chat messages sent as one plain prompt
    (a model without a chat template, e.g. the built-in pair)."""
    out = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            group = row.get("class", path.stem)
            if "messages" not in row and "prompt" not in row:
                raise SystemExit(f"{path}:{n + 1}: expected a 'messages' or a 'prompt' field")
            messages, text = row.get("messages"), row.get("prompt")
            if completions and messages is not None:
                messages, text = None, "\n\n".join(m["content"] for m in messages)
            out.append(Prompt(row.get("id", f"{path.stem}-{n}"), group, messages, text))
    return out


def one_request(client, model: str, prompt: Prompt, setting: str, temperature: float, max_tokens: int, seed: int):
    """One streamed request; returns (latency, TTFT, tokens, text)."""
    extra = {"num_speculative_tokens": 0} if setting == "k0" else {}
    common = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    started = time.perf_counter()
    if prompt.messages is not None:
        stream = client.chat.completions.create(messages=prompt.messages, **common)
    else:
        stream = client.completions.create(prompt=prompt.text, **common)
    first, pieces, tokens = None, [], 0
    for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            piece = choice.delta.content if prompt.messages is not None else choice.text
            if piece:
                first = first or time.perf_counter()
                pieces.append(piece)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return done - started, (first or done) - started, tokens, "".join(pieces)


def run(args: argparse.Namespace) -> tuple[list[Outcome], dict]:
    from openai import OpenAI

    prompts = load_prompts(args.prompts, args.completions)
    groups = sorted({p.group for p in prompts})
    outcomes: list[Outcome] = []
    cells: dict[tuple[str, float, int], Cell] = {}
    with served(args.device, args.serve_flag, args.start_timeout) as nodes:
        client = OpenAI(base_url=f"http://127.0.0.1:{nodes.http}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        workers = ThreadPoolExecutor(max(args.batches))
        deadline = time.monotonic() + args.budget
        for temperature in args.temperatures:
            for batch in args.batches:
                for group in groups:
                    if outcomes and time.monotonic() > deadline:  # a cell runs whole or not at all; one always runs
                        print(f"budget spent: T={temperature} B={batch} {group} and the cells after it not run")
                        workers.shutdown()
                        return outcomes, cells
                    members = [p for p in prompts if p.group == group][: args.prompts_per_group]
                    cell = cells.setdefault((group, temperature, batch), Cell())
                    for r in range(args.rounds):
                        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                            chosen = [members[i % len(members)] for i in range(max(batch, len(members)))]
                            started = time.perf_counter()
                            futures = [
                                workers.submit(
                                    one_request, client, model, p, setting, temperature, args.max_new_tokens, i
                                )
                                for i, p in enumerate(chosen)
                            ]
                            results = [f.result() for f in futures]
                            cell.walls[setting].append(time.perf_counter() - started)
                            cell.tokens[setting].append(sum(tokens for _, _, tokens, _ in results))
                            outcomes += [
                                Outcome(p.id, group, setting, r, temperature, batch, lat, ttft, tokens, text)
                                for p, (lat, ttft, tokens, text) in zip(chosen, results, strict=True)
                            ]
                            print(
                                f"T={temperature} B={batch} {group} round {r} {setting}: "
                                f"{cell.tokens[setting][-1]} tokens in {cell.walls[setting][-1]:.2f} s",
                                flush=True,
                            )
        workers.shutdown()
    return outcomes, cells


def summarise(outcomes: list[Outcome], cells: dict, rounds: int) -> tuple[list[dict], str]:
    rows, table = [], []
    for (group, temperature, batch), cell in sorted(cells.items()):

        def rate(setting: str, which: slice, cell: Cell = cell) -> float:
            tokens, walls = cell.tokens[setting][which], cell.walls[setting][which]
            return sum(tokens) / sum(walls) if walls and sum(walls) > 0 else float("nan")

        steady = slice(1, None) if rounds > 1 else slice(0, None)
        ratio = rate("default", steady) / rate("k0", steady)
        first = rate("default", slice(0, 1)) / rate("k0", slice(0, 1))
        mine = [o for o in outcomes if (o.group, o.temperature, o.batch) == (group, temperature, batch)]
        ttft = {
            s: [o.ttft for o in mine if o.setting == s and o.round > 0] or [o.ttft for o in mine if o.setting == s]
            for s in SETTINGS
        }
        pairs = {}
        for o in mine:
            pairs.setdefault((o.prompt, o.round), {})[o.setting] = o.text
        same = sum(1 for v in pairs.values() if len(v) == 2 and v["default"] == v["k0"])
        stall = 0.0
        for prompt in {o.prompt for o in mine}:
            later = [o.latency for o in mine if o.prompt == prompt and o.round > 0]
            firsts = [o.latency for o in mine if o.prompt == prompt and o.round == 0]
            if later and firsts:
                stall = max(stall, max(firsts) / statistics.median(later))
        row = {
            "group": group,
            "temperature": temperature,
            "batch": batch,
            "tokens_per_s_default": rate("default", steady),
            "tokens_per_s_k0": rate("k0", steady),
            "ratio_steady": ratio,
            "ratio_first_round": first,
            "ttft_median_default": percentile(ttft["default"], 50),
            "ttft_median_k0": percentile(ttft["k0"], 50),
            "ttft_max": max(o.ttft for o in mine),
            "first_over_steady_worst": stall,
            "identical": f"{same}/{len(pairs)}",
        }
        rows.append(row)
        table.append(
            [
                group,
                temperature,
                batch,
                f"{row['tokens_per_s_default']:.1f}",
                f"{row['tokens_per_s_k0']:.1f}",
                f"**{ratio:.2f}x**",
                f"{first:.2f}x",
                f"{1000 * row['ttft_median_default']:.0f} / {1000 * row['ttft_median_k0']:.0f}",
                f"{stall:.2f}",
                row["identical"],
            ]
        )
    header = [
        "group",
        "T",
        "batch",
        "tok/s default",
        "tok/s K=0",
        "steady ratio",
        "first round",
        "TTFT ms default / K=0",
        "first/steady",
        "text = K=0",
    ]
    return rows, markdown_table(header, table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setting; the first is reported apart")
    parser.add_argument("--prompts", type=Path, nargs="+", default=PROMPTS)
    parser.add_argument("--prompts-per-group", type=int, default=64)
    parser.add_argument(
        "--serve-flag", action="append", default=[], help="a flag for `pdspec serve` (repeat; --serve-flag=--x=y)"
    )
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument(
        "--budget", type=float, default=float("inf"), help="seconds after which no cell starts (the first always runs)"
    )
    parser.add_argument("--completions", action="store_true", help="send chat prompts to /v1/completions as text")
    parser.add_argument("--smoke", action="store_true", help="the built-in pair, 1 prompt a group, nothing kept")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.serve_flag = ["--builtin", *args.serve_flag]
        args.prompts_per_group, args.max_new_tokens, args.completions = 1, min(args.max_new_tokens, 12), True
    env = environment()
    outcomes, cells = run(args)
    rows, table = summarise(outcomes, cells, args.rounds)
    flags = " ".join(args.serve_flag) or "(launcher defaults)"
    report(
        "api_speedup",
        env,
        {"flags": flags, "rows": rows},
        f"pdspec serve {flags}\n\n{table}",
        keep=not args.smoke,
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
