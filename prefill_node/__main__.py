"""python -m prefill_node --decode-addr HOST:PORT [...] (every flag: PDSPEC_PREFILL_*)."""

from __future__ import annotations

from pathlib import Path

from pdspec.config import node_options, node_parser, request_limits, speculative_config
from pdspec.logs import setup_logging
from pdspec.serving import serve_until_signal
from pdspec.tls import ClientTls, add_client_flags
from prefill_node.engine import KvTransport, PrefillConfig
from prefill_node.server import PrefillNodeConfig, run_server
from protos.proposal import ProposalEncoding


def build_parser():
    parser = node_parser("prefill", 50051, 9401, "pdspec prefill node")
    parser.add_flag(
        "--decode-addr",
        default="localhost:50052",
        help="decode node(s): HOST:PORT, or dns:///NAME:PORT for round robin over replicas",
    )
    parser.add_flag(
        "--proposal-encoding",
        default="auto",
        choices=["auto", *(e.value for e in ProposalEncoding)],
        help="wire encoding of the draft distributions (auto: point-mass for a point-mass law, else dense)",
    )
    parser.add_flag(
        "--compact-encodings",
        default=False,
        type=bool,
        help="pick the smallest exact encoding (point-mass or sparse) automatically",
    )
    parser.add_flag(
        "--kv-streaming",
        default=False,
        type=bool,
        help="always ship the KV over DecodeStream in slices (else only above --kv-stream-threshold-bytes)",
    )
    parser.add_flag("--kv-stream-threshold-bytes", default=64 << 20, type=int, help="stream a KV larger than this")
    parser.add_flag("--kv-chunk-bytes", default=4 << 20, type=int, help="bytes of KV per DecodeStream chunk")
    parser.add_flag(
        "--kv-layerwise",
        default=False,
        type=bool,
        help="send a streamed KV layer by layer while the prefill runs (DecodeStream, proposal last)",
    )
    parser.add_flag(
        "--kv-transport",
        default="grpc",
        choices=[t.value for t in KvTransport],
        help="grpc, or shm: hand the KV over in /dev/shm (same host; the decode node needs --accept-shm-kv)",
    )
    parser.add_flag(
        "--num-speculative-tokens", default=4, type=int, help="K of a request that does not set it (0 = off)"
    )
    parser.add_flag(
        "--draft-candidates",
        default=1,
        type=int,
        help="candidates per draft node of a request that does not set it (1 = a chain; trees verified exactly)",
    )
    parser.add_flag(
        "--http-ready-wait-seconds",
        default=30.0,
        type=float,
        help="how long an HTTP API request waits for a compatible decode peer before a 503 with Retry-After",
    )
    parser.add_flag(
        "--max-streams", default=160, type=int, help="concurrent Generate streams (then RESOURCE_EXHAUSTED)"
    )
    parser.add_flag(
        "--http-port", default=8000, type=int, help="OpenAI-compatible HTTP API port (0 = any free port, -1 = off)"
    )
    parser.add_flag(
        "--served-model-name", default=None, help="model id of the HTTP API (default: the target's contract name)"
    )
    parser.add_flag(
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on the HTTP API's /v1/* and on PrefillService (gRPC metadata)",
    )
    parser.add_flag("--api-key-file", default=None, type=Path, help="read the API key from this file instead")
    add_client_flags(parser, parser.add_flag, "--decode-tls", "the decode node")
    parser.add_flag(
        "--decode-stall-seconds",
        default=3.0,
        type=float,
        help="cancel a relayed decode stream silent this long (UNAVAILABLE; 0 = off)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> PrefillNodeConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        decode_tls = ClientTls.from_args(
            args.decode_tls_ca,
            args.decode_tls_cert,
            args.decode_tls_key,
            args.decode_tls_server_name,
            prefix="--decode-tls",
        )
    except ValueError as err:
        parser.error(str(err))
    api_key = args.api_key
    if args.api_key_file is not None:
        if api_key:
            parser.error("--api-key and --api-key-file: expected one, got both")
        try:
            api_key = args.api_key_file.read_text().strip()
        except OSError as err:
            parser.error(f"--api-key-file: cannot read {args.api_key_file}: {err}")
        if not api_key:
            parser.error(f"--api-key-file: expected a key in {args.api_key_file}, got an empty file")
    try:
        engine = engine_config(args)
    except ValueError as err:
        parser.error(str(err))
    return PrefillNodeConfig(
        decode_addr=args.decode_addr,
        engine=engine,
        max_streams=args.max_streams,
        http_port=None if args.http_port < 0 else args.http_port,
        served_model_name=args.served_model_name or served_name(args.target_model),
        api_key=api_key or None,
        decode_tls=decode_tls,
        decode_stall_s=args.decode_stall_seconds,
        http_ready_wait_s=args.http_ready_wait_seconds,
        **node_options(args, parser),
    )


def engine_config(args) -> PrefillConfig:
    return PrefillConfig(
        spec=speculative_config(args),
        proposal_encoding=None if args.proposal_encoding == "auto" else ProposalEncoding(args.proposal_encoding),
        compact_encodings=args.compact_encodings,
        kv_streaming=args.kv_streaming,
        kv_stream_threshold_bytes=args.kv_stream_threshold_bytes,
        kv_chunk_bytes=args.kv_chunk_bytes,
        kv_layerwise=args.kv_layerwise,
        kv_transport=KvTransport(args.kv_transport),
        default_max_new_tokens=args.default_max_new_tokens,
        limits=request_limits(args),
        device=args.device,
    )


def served_name(target_model: str | None) -> str:
    """The OpenAI API's model id when --served-model-name is not given: what --target-model
    names (smollm2-135m-instruct, a file's stem, a directory's name)."""
    if not target_model:
        return "pdspec-builtin"
    return Path(target_model).stem if target_model.endswith(".gguf") else Path(target_model).name


def main(argv: list[str] | None = None) -> None:
    args, _ = build_parser().parse_known_args(argv)  # --version and --help exit here
    setup_logging("prefill", args.log_level, args.log_format)
    serve_until_signal(run_server(parse_args(argv)), "prefill")


if __name__ == "__main__":
    main()
