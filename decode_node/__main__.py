"""python -m decode_node [--port 50052] [--metrics-port 9402] ... (every flag: PDSPEC_DECODE_*)."""

from __future__ import annotations

from decode_node.engine import DecodeConfig
from decode_node.server import DecodeNodeConfig, run_server
from engine.options import ADAPTIVE_K, ASYNC_SCHEDULING, SPECULATE_AHEAD
from pdspec.config import node_options, node_parser, request_limits, speculative_config
from pdspec.logs import setup_logging
from pdspec.serving import serve_until_signal


def build_parser():
    parser = node_parser("decode", 50052, 9402, "pdspec decode node")
    parser.add_flag("--max-batch", default=32, type=int, help="requests verified together per step")
    parser.add_flag("--max-queue", default=128, type=int, help="requests waiting for a slot (then RESOURCE_EXHAUSTED)")
    parser.add_flag(
        "--sampler-backend",
        default="auto",
        choices=["auto", "torch", "cupy"],
        help="rejection sampler (auto: cupy on a GPU)",
    )
    parser.add_flag(
        "--async-scheduling",
        default="auto",
        choices=ASYNC_SCHEDULING,
        help="queue a step without speculation before the one before it is read, so the host prepares it while "
        "the GPU runs (auto: on a GPU)",
    )
    parser.add_flag(
        "--speculate-ahead",
        default="off",
        choices=SPECULATE_AHEAD,
        help="with async scheduling, queue prompt-lookup steps that speculate too, each drafting on the "
        "context the step in flight would leave if it accepted all its drafts",
    )
    parser.add_flag(
        "--adaptive-k",
        default="auto",
        choices=ADAPTIVE_K,
        help="pick each request's K every step from its running acceptance and the step costs measured at "
        "start-up (a request's K is then its cap; auto: on for prompt-lookup and hybrid)",
    )
    parser.add_flag(
        "--preempt-after-steps",
        default=64,
        type=int,
        help="a running request that has held its batch slot this many steps while others wait for one gives it "
        "up, and resumes later with its KV recomputed (0: never)",
    )
    parser.add_flag(
        "--pause-backlog",
        default=64,
        type=int,
        help="a stream whose client has not read this many messages is not stepped until it reads (0: never)",
    )
    parser.add_flag(
        "--accept-shm-kv",
        default=False,
        type=bool,
        help="take a KV handed over in /dev/shm by a prefill node on this host (--kv-transport shm)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> DecodeNodeConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine = engine_config(args)
    except ValueError as err:
        parser.error(str(err))
    return DecodeNodeConfig(
        engine=engine, limits=request_limits(args), accept_shm_kv=args.accept_shm_kv, **node_options(args, parser)
    )


def engine_config(args) -> DecodeConfig:
    return DecodeConfig(
        spec=speculative_config(args),
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        default_max_new_tokens=args.default_max_new_tokens,
        sampler_backend=args.sampler_backend,
        device=args.device,
        async_scheduling=args.async_scheduling,
        speculate_ahead=args.speculate_ahead,
        preempt_after_steps=args.preempt_after_steps,
        pause_backlog=args.pause_backlog,
    )


def main(argv: list[str] | None = None) -> None:
    args, _ = build_parser().parse_known_args(argv)  # --version and --help exit here
    setup_logging("decode", args.log_level, args.log_format)
    serve_until_signal(run_server(parse_args(argv)), "decode")


if __name__ == "__main__":
    main()
