"""Structured outputs as users meet them: the OpenAI API with a JSON schema, default speculation
against K = 0 with the same schema, and what the grammar's masks cost a decode step.

    python bench/structured_outputs.py [--model smollm2-135m-instruct | --builtin] [--rounds 3]
        [--max-tokens 256] [--device cpu|cuda] [--smoke]

Both nodes run in this process on loopback as `make run` configures them (prompt lookup with
adaptive K; SmolLM2-135M-Instruct, or the built-in n-gram pair with --builtin). Every request goes
through the official `openai` client to /v1/chat/completions (the built-in pair has no chat
template: /v1/completions) with `response_format: json_schema`, greedy, at batch 1: each prompt
with the server's default speculation and with `num_speculative_tokens: 0`, the order alternating
round by round. Reported per setting: generated tokens per second of wall time and the ratio to
K = 0, whether every output parsed and validated, whether the two settings' texts are identical.

Mask overhead: the decode node's /metrics around the K = 0 requests: the mean time of one
step's masks (`pdspec_grammar_mask_seconds`, one context per row at K = 0) over the mean decode
step (`pdspec_engine_step_seconds`), both of those requests' steps. Writes
bench/results/structured_outputs-<model>-*.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, nodes, report

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "city", "age", "languages", "employed"],
    "additionalProperties": False,
}
RECORDS = [
    "Ada Lovelace lives in London, is 36 years old, speaks English and French, and is employed.",
    "Grace Hopper lives in Arlington, is 85 years old, speaks English and COBOL, and is not employed.",
    "Alan Turing lives in Manchester, is 41 years old, speaks English and German, and is employed.",
    "Katherine Johnson lives in Hampton, is 101 years old, speaks English, and is not employed.",
]
SETTINGS = ("default", "k0")


def instruction(record: str) -> str:
    keys = ", ".join(SCHEMA["properties"])
    return f"Extract the person as JSON with the keys {keys}.\nText: {record}\nJSON:"


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("node", "decode") == "decode":
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--builtin", action="store_true", help="the built-in n-gram pair")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="the built-in pair, one round, nothing kept")
    args = parser.parse_args()
    if args.smoke:
        args.builtin, args.rounds = True, 1

    import jsonschema
    import openai

    from decode_node.engine import DecodeConfig
    from engine.spec_config import SpeculativeConfig
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import PrefillConfig

    env = environment()
    device = args.device
    models = (
        ModelSpec(device=device) if args.builtin else ModelSpec(target_model=args.model, draft_layers=8, device=device)
    )
    spec = SpeculativeConfig(method="prompt-lookup")  # `make run`'s
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    tokens = {s: 0 for s in SETTINGS}
    seconds = {s: 0.0 for s in SETTINGS}
    texts: dict[tuple[str, int, int], str] = {}
    valid = {s: 0 for s in SETTINGS}
    steps = {"mask_s": 0.0, "masks": 0.0, "step_s": 0.0, "steps": 0.0}
    with nodes(
        models=models,
        decode=DecodeConfig(spec=spec, device=device),
        prefill=PrefillConfig(spec=spec, device=device),
        decode_node={"metrics_port": 0},
        prefill_node={"http_port": 0},
    ) as running:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{running.prefill.http_port}/v1", api_key="-", max_retries=0)
        model = api.models.list().data[0].id

        def one(setting: str, record: str) -> tuple[str, int, float]:
            extra = {"response_format": fmt, **({"num_speculative_tokens": 0} if setting == "k0" else {})}
            started = time.perf_counter()
            if args.builtin:
                out = api.completions.create(
                    model=model, prompt=instruction(record), max_tokens=args.max_tokens, temperature=0, extra_body=extra
                )
                text = out.choices[0].text
            else:
                out = api.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": instruction(record)}],
                    max_tokens=args.max_tokens,
                    temperature=0,
                    extra_body=extra,
                )
                text = out.choices[0].message.content
            return text, out.usage.completion_tokens, time.perf_counter() - started

        one("default", RECORDS[0])  # first use of every shape: not timed
        one("k0", RECORDS[0])
        for r in range(args.rounds):
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                before = scrape(running.decode.metrics_port) if setting == "k0" else None
                for i, record in enumerate(RECORDS):
                    text, n, wall = one(setting, record)
                    tokens[setting] += n
                    seconds[setting] += wall
                    texts[setting, r, i] = text
                    try:
                        jsonschema.validate(json.loads(text), SCHEMA)
                        valid[setting] += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
                if before is not None:
                    after = scrape(running.decode.metrics_port)
                    steps["mask_s"] += (
                        after["pdspec_grammar_mask_seconds_sum"] - before["pdspec_grammar_mask_seconds_sum"]
                    )
                    steps["masks"] += (
                        after["pdspec_grammar_mask_seconds_count"] - before["pdspec_grammar_mask_seconds_count"]
                    )
                    steps["step_s"] += (
                        after["pdspec_engine_step_seconds_sum"] - before["pdspec_engine_step_seconds_sum"]
                    )
                    steps["steps"] += (
                        after["pdspec_engine_step_seconds_count"] - before["pdspec_engine_step_seconds_count"]
                    )
    requests = args.rounds * len(RECORDS)
    rate = {s: tokens[s] / seconds[s] for s in SETTINGS}
    identical = all(
        texts["default", r, i] == texts["k0", r, i] for r in range(args.rounds) for i in range(len(RECORDS))
    )
    mask_us = steps["mask_s"] / max(steps["masks"], 1) * 1e6
    step_ms = steps["step_s"] / max(steps["steps"], 1) * 1e3
    rows = [
        {
            "setting": s,
            "tokens": tokens[s],
            "tokens_per_s": rate[s],
            "speedup_vs_k0": rate[s] / rate["k0"],
            "valid": f"{valid[s]}/{requests}",
        }
        for s in SETTINGS
    ]
    overhead = {"mask_us_per_step": mask_us, "k0_step_ms": step_ms, "overhead_pct": mask_us / 1e3 / step_ms * 100}
    table = markdown_table(
        ["setting", "tokens", "tokens/s", "vs K = 0", "valid"],
        [
            [r["setting"], r["tokens"], f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_k0']:.2f}x", r["valid"]]
            for r in rows
        ],
    )
    table += (
        f"\n\ntexts identical (default vs K = 0, greedy): {identical}\n"
        f"K = 0 steps: masks {mask_us:.1f} us per step, decode step {step_ms:.2f} ms: "
        f"{overhead['overhead_pct']:.2f}% of a step"
    )
    env["model"] = "builtin" if args.builtin else args.model
    report(
        f"structured_outputs-{Path(env['model']).stem}",  # a checkpoint path: its file's name
        env,
        {"rows": rows, "identical": identical, "overhead": overhead, "schema": SCHEMA},
        table,
        keep=not args.smoke,
    )


if __name__ == "__main__":
    main()
