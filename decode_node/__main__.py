"""python -m decode_node [--port 50052] [--metrics-port 9402] ... (every flag: PDSPEC_DECODE_*)."""

from __future__ import annotations

import logging
from pathlib import Path

from decode_node.engine import DecodeConfig
from decode_node.server import DecodeNodeConfig, run_server
from pdspec.config import EnvArgumentParser
from pdspec.serving import serve_until_signal
from sampling.proposal import DraftLaw


def parse_args(argv: list[str] | None = None) -> DecodeNodeConfig:
    parser = EnvArgumentParser("decode", prog="python -m decode_node", description="pdspec decode node")
    parser.add_flag("--host", default="0.0.0.0", help="address to bind")
    parser.add_flag("--port", default=50052, type=int, help="gRPC port (0 = any free port)")
    parser.add_flag("--metrics-port", default=9402, type=int, help="Prometheus /metrics port (-1 = off)")
    parser.add_flag("--corpus", default=None, type=Path, help="built-in pair's corpus (default: Python's stdlib)")
    parser.add_flag("--target-model", default=None, type=Path, help="HF checkpoint directory of the target")
    parser.add_flag("--draft-model", default=None, type=Path, help="HF checkpoint directory of the draft")
    parser.add_flag("--max-speculative-tokens", default=8, type=int, help="largest K a request may ask for")
    parser.add_flag("--max-batch", default=32, type=int, help="requests verified together per step")
    parser.add_flag("--max-queue", default=128, type=int, help="requests waiting for a slot (then RESOURCE_EXHAUSTED)")
    parser.add_flag(
        "--draft-sampling",
        default="point-mass",
        choices=[law.value for law in DraftLaw],
        help="law of the local draft after the first step",
    )
    parser.add_flag("--default-max-new-tokens", default=64, type=int, help="when a request says 0")
    parser.add_flag(
        "--sampler-backend",
        default="auto",
        choices=["auto", "torch", "cupy"],
        help="rejection sampler (auto: cupy on a GPU)",
    )
    parser.add_flag("--device", default="cpu", help="torch device of the sampler")
    parser.add_flag("--max-message-bytes", default=None, type=int, help="gRPC message limit (default: derived)")
    parser.add_flag("--grace-seconds", default=5.0, type=float, help="drain time on shutdown")
    args = parser.parse_args(argv)
    engine = DecodeConfig(
        max_speculative_tokens=args.max_speculative_tokens,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        draft_law=DraftLaw(args.draft_sampling),
        default_max_new_tokens=args.default_max_new_tokens,
        sampler_backend=args.sampler_backend,
        device=args.device,
    )
    return DecodeNodeConfig(
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    serve_until_signal(run_server(parse_args(argv)))


if __name__ == "__main__":
    main()
