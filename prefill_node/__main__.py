"""python -m prefill_node --decode-addr HOST:PORT [...] (every flag: PDSPEC_PREFILL_*)."""

from __future__ import annotations

import logging
from pathlib import Path

from pdspec.config import node_options, node_parser, request_limits
from pdspec.serving import serve_until_signal
from prefill_node.engine import PrefillConfig
from prefill_node.server import PrefillNodeConfig, run_server
from protos.proposal import ProposalEncoding
from sampling.proposal import DraftLaw


def parse_args(argv: list[str] | None = None) -> PrefillNodeConfig:
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
        "--num-speculative-tokens", default=4, type=int, help="K of a request that does not set it (0 = off)"
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
    parser.add_flag("--api-key", default=None, help="require Authorization: Bearer KEY on the HTTP API's /v1/*")
    parser.add_flag("--api-key-file", default=None, type=Path, help="read the API key from this file instead")
    args = parser.parse_args(argv)
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
    engine = PrefillConfig(
        draft_law=DraftLaw(args.draft_sampling),
        proposal_encoding=None if args.proposal_encoding == "auto" else ProposalEncoding(args.proposal_encoding),
        compact_encodings=args.compact_encodings,
        kv_streaming=args.kv_streaming,
        kv_stream_threshold_bytes=args.kv_stream_threshold_bytes,
        kv_chunk_bytes=args.kv_chunk_bytes,
        max_speculative_tokens=args.max_speculative_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        default_max_new_tokens=args.default_max_new_tokens,
        limits=request_limits(args),
        device=args.device,
    )
    return PrefillNodeConfig(
        decode_addr=args.decode_addr,
        engine=engine,
        max_streams=args.max_streams,
        http_port=None if args.http_port < 0 else args.http_port,
        served_model_name=args.served_model_name,
        api_key=api_key or None,
        **node_options(args),
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    serve_until_signal(run_server(parse_args(argv)))


if __name__ == "__main__":
    main()
