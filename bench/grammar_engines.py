"""The two grammar engines a structured-output server can use, side by side on this machine.

    python bench/grammar_engines.py [--tokenizers byte,smollm2] [--steps 64] [--smoke]

xgrammar pulls transformers, triton, apache-tvm-ffi and pydantic; run this script from an
environment that has both engines (a scratch venv whose site-packages also see the project's):

    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install xgrammar && /tmp/xg/bin/python bench/grammar_engines.py

For each tokenizer (the built-in pair's byte-level one, SmolLM2-135M's 49,152-token BPE) and
each schema of a fixed set (objects, enums, bounded arrays, nesting, patterns, formats, $ref,
anyOf, additionalProperties): whether the engine compiles it, the compile time (fresh, no
cache), and the time to compute the next-token mask per token while a matcher walks a valid
instance of the schema token by token, at batch 1 (one matcher) and batch 16 (16 matchers
filled by the engine's batch call). A schema an engine refuses is listed with its message.
Writes bench/results/grammar_engines-*.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, report

SCHEMAS: dict[str, tuple[dict, object]] = {
    "object+enum": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "colour": {"enum": ["red", "green", "blue"]},
                "age": {"type": "integer", "minimum": 0},
            },
            "required": ["name", "colour", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada", "colour": "green", "age": 36},
    ),
    "array bounds": (
        {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 4},
        [1.5, 2, -3.25],
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["id", "tags"],
                },
                "ok": {"type": "boolean"},
            },
            "required": ["user", "ok"],
        },
        {"user": {"id": 7, "tags": ["a", "bc"]}, "ok": True},
    ),
    "pattern": (
        {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
        {"zip": "02139"},
    ),
    "format date-time": (
        {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}, "required": ["at"]},
        {"at": "2026-12-04T20:31:34Z"},
    ),
    "$ref + anyOf": (
        {
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
            "anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}],
        },
        {"x": 1},
    ),
    "string length": (
        {
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
            "required": ["code"],
        },
        {"code": "abcd"},
    ),
    "free object": ({"type": "object"}, {"k": [1, {"z": None}], "s": "text"}),
}


def byte_vocab() -> tuple[list[bytes], int]:
    """The built-in pair's vocabulary: 256 bytes, then the special ids (EOS)."""
    from models.ngram import EOS

    return [bytes([i]) for i in range(256)] + [b"<eos>"] * (EOS - 255), EOS


def hf_tokenizer(name: str):
    from models.checkpoint import load_gguf_tokenizer
    from models.loader import resolve_model_spec

    return load_gguf_tokenizer(resolve_model_spec(name)).tokenizer


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: str) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        if tokenizer == "byte":
            tokens, eos = byte_vocab()
            wrapper = _ByteWrapper(tokens, eos)
            self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper))
            self.encode = lambda s: list(s.encode())
        else:
            hf = hf_tokenizer(tokenizer)
            self.tok = llguidance.hf.from_tokenizer(hf)
            self.encode = lambda s: hf.encode(s, add_special_tokens=False)
        self.vocab = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matchers(self, compiled, n: int):
        return [self.ll.LLMatcher(self.tok, compiled) for _ in range(n)]

    def walk(self, matchers, tokens: list[int]) -> float:
        """Seconds per token computing the masks of all matchers (consuming is not timed)."""
        bitmask = self.llt.allocate_token_bitmask(len(matchers), self.vocab)
        spent = 0.0
        for token in tokens:
            start = time.perf_counter()
            if len(matchers) == 1:
                self.llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
            else:
                self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
            spent += time.perf_counter() - start
            for m in matchers:
                assert m.consume_token(token), m.get_error()
        return spent / len(tokens)


class _ByteWrapper:
    def __init__(self, tokens: list[bytes], eos: int) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = [eos]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: str) -> None:
        import xgrammar

        self.xgr = xgrammar
        if tokenizer == "byte":
            tokens, eos = byte_vocab()
            info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos])
            self.encode = lambda s: list(s.encode())
        else:
            hf = hf_tokenizer(tokenizer)
            info = xgrammar.TokenizerInfo.from_huggingface(hf)
            self.encode = lambda s: hf.encode(s, add_special_tokens=False)
        self.info, self.vocab = info, info.vocab_size

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def walk(self, matchers, tokens: list[int]) -> float:
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab)
        batch = self.xgr.BatchGrammarMatcher() if len(matchers) > 1 else None
        spent = 0.0
        for token in tokens:
            start = time.perf_counter()
            if batch is None:
                matchers[0].fill_next_token_bitmask(bitmask, 0)
            else:
                batch.batch_fill_next_token_bitmask(matchers, bitmask)
            spent += time.perf_counter() - start
            for m in matchers:
                assert m.accept_token(token)
        return spent / len(tokens)


def measure(engine, steps: int) -> list[dict]:
    rows = []
    for name, (schema, instance) in SCHEMAS.items():
        row = {"engine": engine.name, "schema": name}
        start = time.perf_counter()
        try:
            compiled = engine.compile(schema)
        except Exception as error:  # an engine's refusal is a finding, whatever its type
            rows.append({**row, "supported": False, "error": str(error)[:200]})
            continue
        row["compile_ms"] = (time.perf_counter() - start) * 1e3
        tokens = engine.encode(json.dumps(instance, separators=(",", ":")))[:steps]
        try:
            per_batch = {}
            for batch in (1, 16):
                times = [engine.walk(engine.matchers(compiled, batch), tokens) for _ in range(3)]
                per_batch[batch] = statistics.median(times) * 1e6
        except AssertionError as error:
            rows.append({**row, "supported": False, "error": f"refused a valid instance: {error}"[:200]})
            continue
        rows.append({**row, "supported": True, "mask_us_b1": per_batch[1], "mask_us_b16": per_batch[16]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizers", default="byte,smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=64, help="tokens of each instance walked")
    parser.add_argument("--smoke", action="store_true", help="the byte tokenizer only, no results file")
    args = parser.parse_args()
    env = environment()
    rows = []
    tokenizers = ["byte"] if args.smoke else args.tokenizers.split(",")
    for tokenizer in tokenizers:
        for engine_class in (Llguidance, Xgrammar):
            engine = engine_class(tokenizer)
            rows += [{"tokenizer": tokenizer, "vocab": engine.vocab, **row} for row in measure(engine, args.steps)]
    table = markdown_table(
        ["tokenizer", "engine", "schema", "compile ms", "mask µs/token b1", "mask µs/token b16 (all 16)"],
        [
            [
                r["tokenizer"],
                r["engine"],
                r["schema"],
                f"{r['compile_ms']:.1f}" if "compile_ms" in r else "-",
                f"{r['mask_us_b1']:.1f}" if r["supported"] else "refused: " + r["error"][:60],
                f"{r['mask_us_b16']:.1f}" if r["supported"] else "-",
            ]
            for r in rows
        ],
    )
    import importlib.metadata

    for package in ("llguidance", "xgrammar"):
        env[package] = importlib.metadata.version(package)
    report("grammar_engines", env, rows, table, keep=not args.smoke)


if __name__ == "__main__":
    main()
