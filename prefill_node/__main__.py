"""python -m prefill_node --decode-addr HOST:PORT [...] (every flag: PDSPEC_PREFILL_*)."""

from __future__ import annotations

import logging

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
    parser.add_flag(
        "--num-speculative-tokens", default=4, type=int, help="K of a request that does not set it (0 = off)"
    )
    parser.add_flag(
        "--max-streams", default=160, type=int, help="concurrent Generate streams (then RESOURCE_EXHAUSTED)"
    )
    args = parser.parse_args(argv)
    engine = PrefillConfig(
        draft_law=DraftLaw(args.draft_sampling),
        proposal_encoding=ProposalEncoding(args.proposal_encoding),
        compact_encodings=args.compact_encodings,
        max_speculative_tokens=args.max_speculative_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        default_max_new_tokens=args.default_max_new_tokens,
        limits=request_limits(args),
        device=args.device,
    )
    return PrefillNodeConfig(
        decode_addr=args.decode_addr, engine=engine, max_streams=args.max_streams, **node_options(args)
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    serve_until_signal(run_server(parse_args(argv)))


if __name__ == "__main__":
    main()
