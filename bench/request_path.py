"""Where a request's time goes between the client and the engines, at batch 1.

    python bench/request_path.py [--device cpu|cuda] [--max-new-tokens 128] [--prompts-per-group 2]
        [--rounds 3] [--serve-flag=--x=y ...] [--smoke]

Both nodes start as `pdspec serve` starts them (the launcher's default flags plus any
`--serve-flag`). One request at a time, each prompt is sent four ways, alternated: streamed
through the OpenAI HTTP API (`/v1/completions`, the official `openai` client) and through the
prefill node's gRPC `Generate` (pdspec.client), each with the default speculation and with
`num_speculative_tokens: 0`. Around every request both nodes' /metrics are read once the
decode node is idle: with one request running, every engine step is its own, so its engine
time on each node is the increase of `pdspec_engine_step_seconds_sum`.

Per path and setting (medians over the requests after the first round): wall time, TTFT, the
prefill and decode engines' time, and the rest — time outside any engine step: parsing,
tokenising, the prefill -> decode handoff, the relay of every message over both hops, the
client — in ms, per message, and as a share of the wall time. HTTP minus gRPC is the HTTP
layer. In-process, on the served model's tokenizer: the chat template plus tokenising of each
prompt, and detokenising the response token by token (the relay's incremental detokenizer).
Writes bench/results/request_path-*.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.api_speedup import PROMPTS, Prompt, load_prompts
from bench.harness import environment, markdown_table, report, scrape, served, wait_until

PATHS = ("http", "grpc")
SETTINGS = ("default", "k0")
STEP = "pdspec_engine_step_seconds"


@dataclass
class Sample:
    path: str
    setting: str
    round: int
    wall: float
    ttft: float
    messages: int
    tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def outside(self) -> float:
        return self.wall - self.prefill_s - self.decode_s


def engine_totals(ports: dict[str, int]) -> tuple[float, float, int]:
    """(prefill step seconds, decode step seconds, decode steps) once the decode node is idle and
    its last step is counted (the final message leaves before its step is recorded)."""
    last: list[tuple[float, float, int]] = []

    def settled() -> bool:
        prefill, decode = scrape(ports["prefill-metrics"]), scrape(ports["decode-metrics"])
        now = (
            prefill.get((f"{STEP}_sum", (("node", "prefill"),)), 0.0),
            decode.get((f"{STEP}_sum", (("node", "decode"),)), 0.0),
            int(decode.get((f"{STEP}_count", (("node", "decode"),)), 0)),
        )
        idle = decode.get(("pdspec_running_requests", (("node", "decode"),)), 0) == 0
        steady = bool(last) and last[-1] == now
        last.append(now)
        return idle and steady

    wait_until(settled, timeout=30, what="the decode node to go idle")
    return last[-1]


def over_http(client, model: str, prompt: Prompt, setting: str, max_tokens: int) -> tuple[float, float, int, int]:
    extra = {"num_speculative_tokens": 0} if setting == "k0" else {}
    started = time.perf_counter()
    stream = client.completions.create(
        model=model,
        prompt=prompt.text,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    first, messages, tokens = None, 0, 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
        messages += bool(chunk.choices)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return done - started, (first or done) - started, messages, tokens


def over_grpc(client, prompt: Prompt, setting: str, max_tokens: int) -> tuple[float, float, int, int]:
    extra = {"num_speculative_tokens": 0} if setting == "k0" else {}
    started = time.perf_counter()
    first, messages, tokens = None, 0, 0
    for response in client.stream(prompt.text, max_new_tokens=max_tokens, greedy=True, **extra):
        first = first or time.perf_counter()
        messages += 1
        tokens += len(response.token_ids)
    done = time.perf_counter()
    return done - started, (first or done) - started, messages, tokens


def in_process(prompts: list[Prompt], chat_prompts: list[Prompt], tokens: int, builtin: bool) -> dict:
    """The tokenizer's share, timed here on the served model's tokenizer."""
    if builtin:
        return {}
    from models.checkpoint import load_gguf_tokenizer
    from models.loader import SMOLLM2, resolve_model_spec

    tokenizer = load_gguf_tokenizer(resolve_model_spec(SMOLLM2))
    template, encode, detok = [], [], []
    for prompt in chat_prompts:
        started = time.perf_counter()
        text = tokenizer.apply_chat_template(prompt.messages)
        templated = time.perf_counter()
        tokenizer.encode(text)
        template.append(templated - started)
        encode.append(time.perf_counter() - templated)
    for prompt in prompts:
        ids = (tokenizer.encode(prompt.text) * (1 + tokens // 8))[:tokens]  # a response-length stream
        decoder, started = tokenizer.incremental(), time.perf_counter()
        for token in ids:
            decoder.push([token])
        decoder.flush()
        detok.append((time.perf_counter() - started) / len(ids))
    return {
        "chat_template_ms": round(statistics.median(template) * 1e3, 3),
        "encode_ms": round(statistics.median(encode) * 1e3, 3),
        "detokenise_us_per_token": round(statistics.median(detok) * 1e6, 2),
    }


def run(args: argparse.Namespace) -> tuple[list[Sample], dict]:
    from openai import OpenAI

    from pdspec.client import Client

    prompts = load_prompts(args.prompts, completions=True)
    chosen = []
    for group in sorted({p.group for p in prompts}):
        chosen += [p for p in prompts if p.group == group][: args.prompts_per_group]
    samples: list[Sample] = []
    with served(args.device, args.serve_flag, args.start_timeout) as nodes:
        http = OpenAI(base_url=f"http://127.0.0.1:{nodes.http}/v1", api_key="none", max_retries=0, timeout=600)
        model = http.models.list().data[0].id
        grpc_client = Client(f"127.0.0.1:{nodes.ports['prefill']}")
        for r in range(args.rounds):
            for i, prompt in enumerate(chosen):
                ways = [(p, s) for p in PATHS for s in SETTINGS]
                for path, setting in ways if (r + i) % 2 == 0 else ways[::-1]:
                    before = engine_totals(nodes.ports)
                    if path == "http":
                        wall, ttft, messages, tokens = over_http(http, model, prompt, setting, args.max_new_tokens)
                    else:
                        wall, ttft, messages, tokens = over_grpc(grpc_client, prompt, setting, args.max_new_tokens)
                    after = engine_totals(nodes.ports)
                    samples.append(
                        Sample(
                            path,
                            setting,
                            r,
                            wall,
                            ttft,
                            messages,
                            tokens,
                            after[0] - before[0],
                            after[1] - before[1],
                            after[2] - before[2],
                        )
                    )
            print(f"round {r}: {len(samples)} requests", flush=True)
        grpc_client.close()
    chat = [p for p in load_prompts(args.prompts) if p.messages is not None][: 4 * args.prompts_per_group]
    return samples, in_process(chosen, chat, args.max_new_tokens, "--builtin" in args.serve_flag)


def summarise(samples: list[Sample], rounds: int) -> tuple[list[dict], str]:
    steady = [s for s in samples if s.round > 0 or rounds == 1]
    rows, table = [], []
    for path in PATHS:
        for setting in SETTINGS:
            mine = [s for s in steady if s.path == path and s.setting == setting]
            if not mine:
                continue

            def med(values: list[float]) -> float:
                return statistics.median(values) * 1e3

            row = {
                "path": path,
                "setting": setting,
                "requests": len(mine),
                "wall_ms": med([s.wall for s in mine]),
                "ttft_ms": med([s.ttft for s in mine]),
                "prefill_engine_ms": med([s.prefill_s for s in mine]),
                "decode_engine_ms": med([s.decode_s for s in mine]),
                "decode_steps": statistics.median([s.decode_steps for s in mine]),
                "messages": statistics.median([s.messages for s in mine]),
                "tokens": statistics.median([s.tokens for s in mine]),
                "outside_ms": med([s.outside for s in mine]),
                "outside_share": statistics.median([s.outside / s.wall for s in mine]),
                "outside_per_message_ms": med([s.outside / max(s.messages, 1) for s in mine]),
            }
            rows.append(row)
            table.append(
                [
                    path,
                    setting,
                    f"{row['wall_ms']:.1f}",
                    f"{row['ttft_ms']:.1f}",
                    f"{row['prefill_engine_ms']:.1f}",
                    f"{row['decode_engine_ms']:.1f} ({row['decode_steps']:.0f})",
                    f"{row['messages']:.0f}",
                    f"{row['outside_ms']:.1f}",
                    f"{100 * row['outside_share']:.1f}%",
                    f"{row['outside_per_message_ms']:.3f}",
                ]
            )
    header = [
        "path",
        "K",
        "wall ms",
        "TTFT ms",
        "prefill engine ms",
        "decode engine ms (steps)",
        "messages",
        "outside the engines ms",
        "share",
        "per message ms",
    ]
    return rows, markdown_table(header, table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="the first is a warm-up, reported apart")
    parser.add_argument("--prompts", type=Path, nargs="+", default=PROMPTS)
    parser.add_argument("--prompts-per-group", type=int, default=2)
    parser.add_argument(
        "--serve-flag", action="append", default=[], help="a flag for `pdspec serve` (repeat; --serve-flag=--x=y)"
    )
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--smoke", action="store_true", help="the built-in pair, 1 prompt a group, nothing kept")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.serve_flag = ["--builtin", *args.serve_flag]
        args.prompts_per_group, args.max_new_tokens, args.rounds = 1, min(args.max_new_tokens, 12), 2
    env = environment()
    samples, tokenizer = run(args)
    rows, table = summarise(samples, args.rounds)
    flags = " ".join(args.serve_flag) or "(launcher defaults)"
    first = [s.__dict__ for s in samples if s.round == 0]
    lines = [f"pdspec serve {flags}, batch 1, {args.max_new_tokens} new tokens, greedy", "", table]
    if tokenizer:
        lines += ["", f"in-process, the served tokenizer: {tokenizer}"]
    report(
        "request_path",
        env,
        {"flags": flags, "rows": rows, "tokenizer": tokenizer, "first_round": first},
        "\n".join(lines),
        keep=not args.smoke,
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
