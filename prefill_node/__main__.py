"""python -m prefill_node --decode-addr HOST:PORT [...] (every flag: PDSPEC_PREFILL_*)."""

from __future__ import annotations

import logging
from pathlib import Path

from pdspec.config import EnvArgumentParser
from pdspec.serving import serve_until_signal
from prefill_node.engine import PrefillConfig
from prefill_node.server import PrefillNodeConfig, run_server
from protos.proposal import ProposalEncoding
from sampling.proposal import DraftLaw


def parse_args(argv: list[str] | None = None) -> PrefillNodeConfig:
    parser = EnvArgumentParser("prefill", prog="python -m prefill_node", description="pdspec prefill node")
    parser.add_flag(
        "--decode-addr",
        default="localhost:50052",
        help="decode node(s): HOST:PORT, or dns:///NAME:PORT for round robin over replicas",
    )
    parser.add_flag("--host", default="0.0.0.0", help="address to bind")
    parser.add_flag("--port", default=50051, type=int, help="gRPC port (0 = any free port)")
    parser.add_flag("--metrics-port", default=9401, type=int, help="Prometheus /metrics port (-1 = off)")
    parser.add_flag("--corpus", default=None, type=Path, help="built-in pair's corpus (default: Python's stdlib)")
    parser.add_flag("--target-model", default=None, type=Path, help="HF checkpoint directory of the target")
    parser.add_flag("--draft-model", default=None, type=Path, help="HF checkpoint directory of the draft")
    parser.add_flag(
        "--draft-sampling",
        default="point-mass",
        choices=[law.value for law in DraftLaw],
        help="how the draft proposes: top-1 point mass, or sampling with the request's parameters",
    )
    parser.add_flag(
        "--proposal-encoding",
        default="dense",
        choices=[e.value for e in ProposalEncoding],
        help="wire encoding of the draft distributions",
    )
    parser.add_flag(
        "--compact-encodings",
        default=False,
        type=bool,
        help="pick the smallest exact encoding (point-mass or sparse) automatically",
    )
    parser.add_flag("--max-speculative-tokens", default=8, type=int, help="largest K accepted (and the peer's)")
    parser.add_flag("--default-max-new-tokens", default=64, type=int, help="when a request says 0")
    parser.add_flag("--max-message-bytes", default=None, type=int, help="gRPC message limit (default: derived)")
    parser.add_flag("--grace-seconds", default=5.0, type=float, help="drain time on shutdown")
    args = parser.parse_args(argv)
    engine = PrefillConfig(
        draft_law=DraftLaw(args.draft_sampling),
        proposal_encoding=ProposalEncoding(args.proposal_encoding),
        compact_encodings=args.compact_encodings,
        max_speculative_tokens=args.max_speculative_tokens,
        default_max_new_tokens=args.default_max_new_tokens,
    )
    return PrefillNodeConfig(
        decode_addr=args.decode_addr,
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        engine=engine,
        corpus=args.corpus,
        target_model=args.target_model,
        draft_model=args.draft_model,
        max_message_bytes=args.max_message_bytes,
        grace_s=args.grace_seconds,
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    serve_until_signal(run_server(parse_args(argv)))


if __name__ == "__main__":
    main()
