"""The `pdspec` command line: serve, generate, info, demo, train-draft. Every flag also reads PDSPEC_CLI_<FLAG>."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import grpc
from google.protobuf import json_format

from pdspec.client import Client, decode_info
from pdspec.config import EnvArgumentParser, read_peer_token
from pdspec.tls import ClientTls, add_client_flags
from protos import pdspec_pb2


def main(argv: list[str] | None = None) -> int:
    import pdspec

    parser = EnvArgumentParser("cli", prog="pdspec", description="pdspec command line")
    parser.add_argument("--version", action="version", version=f"pdspec {pdspec.__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=functools.partial(EnvArgumentParser, "cli")
    )

    gen = commands.add_parser("generate", help="stream text from the prefill node")
    _flags(
        gen,
        [
            ("--prefill-addr", {"default": "localhost:50051", "help": "prefill node"}),
            ("--max-new-tokens", {"default": 64, "type": int, "help": "tokens to generate (the first included)"}),
            ("--temperature", {"default": 1.0, "type": float, "help": "sampling temperature"}),
            ("--top-k", {"default": 0, "type": int, "help": "top-k (0 = off)"}),
            ("--top-p", {"default": 1.0, "type": float, "help": "top-p (1 = off)"}),
            ("--seed", {"default": None, "type": int, "help": "request seed (reproducible output)"}),
            ("--greedy", {"default": False, "type": bool, "help": "argmax decoding"}),
            (
                "--num-spec-tokens",
                {"default": None, "type": int, "help": "draft tokens per step K (0 = off; default: the server's)"},
            ),
            (
                "--draft-candidates",
                {"default": None, "type": int, "help": "candidates per draft node (> 1: multi-draft trees)"},
            ),
            ("--json-schema", {"default": None, "help": "structured output: a JSON Schema file the output follows"}),
            ("--json-object", {"default": False, "type": bool, "help": "structured output: any JSON object"}),
            ("--regex", {"default": None, "help": "structured output: the whole output matches this regex"}),
            ("--grammar", {"default": None, "help": "structured output: a Lark (or GBNF) grammar file"}),
            ("--stats", {"default": False, "type": bool, "help": "print acceptance per position and tokens/s"}),
            ("--timeout", {"default": 0.0, "type": float, "help": "deadline in seconds (0 = none)"}),
        ],
    )
    _security_flags(gen)
    gen.add_argument("prompt", help="prompt text (- reads it from standard input)")

    info = commands.add_parser("info", help="the nodes' GetInfo as JSON")
    _flags(
        info,
        [
            ("--prefill-addr", {"default": "localhost:50051", "help": "prefill node"}),
            ("--decode-addr", {"default": "localhost:50052", "help": "decode node"}),
            ("--node", {"default": "both", "choices": ["both", "prefill", "decode"], "help": "which node to ask"}),
            ("--peer-token-file", {"default": None, "help": "the decode node's peer token, when it requires one"}),
        ],
    )
    _security_flags(info)
    commands.add_parser("demo", help="rejection-sampling demo (no servers needed)", add_help=False)
    commands.add_parser("serve", help="run a decode and a prefill node here (as `make run` does)", add_help=False)
    commands.add_parser("train-draft", help="distil a small draft model from a target", add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from sampling import demo

        demo.main(rest)
        return 0
    if args.command == "serve":
        from pdspec import local

        local.main(rest)
        return 0
    if args.command == "train-draft":
        from pdspec import train_draft

        return train_draft.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.tls = ClientTls.from_args(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    except ValueError as err:
        parser.error(str(err))
    if args.command == "generate":
        try:
            args.structured_output = _structured_output(args)
        except (OSError, ValueError) as err:
            parser.error(str(err))
    try:
        return _generate(args) if args.command == "generate" else _info(args)
    except grpc.RpcError as err:
        print(f"pdspec: {err.code().name}: {err.details()}", file=sys.stderr)
        if err.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" not in (err.details() or ""):
            print(
                "pdspec: is a node running there? Start both with `pdspec serve` (or `make run`), or point "
                "--prefill-addr / --decode-addr at yours.",
                file=sys.stderr,
            )
        return 1
    except KeyboardInterrupt:
        return 130


def _flags(sub: EnvArgumentParser, flags) -> None:
    for flag, kwargs in flags:
        sub.add_flag(flag, **kwargs)


def _security_flags(sub: EnvArgumentParser) -> None:
    add_client_flags(sub, sub.add_flag, what="a node")
    sub.add_flag("--api-key", default=None, help="the prefill node's API key (sent as Authorization: Bearer KEY)")


def _client(args) -> Client:
    tls = args.tls or ClientTls()
    return Client(
        args.prefill_addr,
        tls_ca=tls.ca,
        tls_cert=tls.cert,
        tls_key=tls.key,
        tls_server_name=tls.server_name,
        api_key=args.api_key,
    )


def _structured_output(args) -> pdspec_pb2.StructuredOutput | None:
    """The constraint of --json-schema FILE / --json-object / --regex / --grammar FILE (at most one)."""
    given = [name for name in ("json_schema", "json_object", "regex", "grammar") if getattr(args, name)]
    if len(given) > 1:
        flags = "--json-schema, --json-object, --regex, --grammar"
        raise ValueError(f"structured output: expected at most one of {flags}, got {len(given)}")
    if not given:
        return None
    out = pdspec_pb2.StructuredOutput()
    if args.json_schema:
        schema = json.loads(Path(args.json_schema).read_text())  # a ValueError names what is wrong
        out.json_schema = json.dumps(schema)
    elif args.json_object:
        out.json_object = True
    elif args.regex:
        out.regex = args.regex
    else:
        out.grammar = Path(args.grammar).read_text()
    return out


def _generate(args) -> int:
    started = time.monotonic()
    with _client(args) as client:
        tokens, stats = 0, None
        for response in client.stream(
            sys.stdin.read() if args.prompt == "-" else args.prompt,
            max_new_tokens=args.max_new_tokens,
            greedy=args.greedy,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            num_speculative_tokens=args.num_spec_tokens,
            draft_candidates=args.draft_candidates,
            timeout=args.timeout or None,
            structured_output=args.structured_output,
        ):
            print(response.text, end="", flush=True)
            tokens += len(response.token_ids)
            if response.finished:
                stats = response.stats
                print(f"\n[finished: {response.finish_reason}]")
    if args.stats and stats is not None:
        elapsed = time.monotonic() - started
        rate = stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0
        print(
            f"tokens: {tokens} in {elapsed:.2f}s ({tokens / elapsed:.1f} tokens/s); verify steps: "
            f"{stats.verify_steps}; acceptance: {rate:.3f}"
        )
        for position, count in enumerate(stats.accepted_per_position):
            print(f"  position {position}: accepted {count}/{stats.verify_steps}")
    return 0


def _info(args) -> int:
    """GetInfo of the asked nodes as one JSON object ({"prefill": ..., "decode": ...})."""
    out = {}
    if args.node in ("both", "prefill"):
        with _client(args) as client:
            out["prefill"] = _info_dict(client.info())
    if args.node in ("both", "decode"):
        token = read_peer_token(Path(args.peer_token_file)) if args.peer_token_file else None
        out["decode"] = _info_dict(decode_info(args.decode_addr, tls=args.tls, peer_token=token))
    print(json.dumps(out, indent=2))
    return 0


def _info_dict(info) -> dict:
    shown = json_format.MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if shown.get("backends"):
        shown["backends"] = json.loads(shown["backends"])
    return shown


if __name__ == "__main__":
    sys.exit(main())
