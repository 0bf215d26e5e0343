"""Exit 0 iff a node answers grpc.health.v1 SERVING (the Docker HEALTHCHECK).

python -m pdspec.healthcheck [--addr localhost:50052] [--service NAME]
    [--tls-ca CA.pem [--tls-cert CLIENT.pem --tls-key CLIENT-key.pem] [--tls-server-name NAME]]

Every flag also reads PDSPEC_HEALTH_<FLAG> (PDSPEC_HEALTH_ADDR, PDSPEC_HEALTH_TLS_CA, ...),
so an image's HEALTHCHECK follows the container's environment.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspec.config import EnvArgumentParser
from pdspec.tls import ClientTls, add_client_flags, channel


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser("health", prog="python -m pdspec.healthcheck", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_flag("--addr", default="localhost:50052", help="the node's gRPC address")
    parser.add_flag("--service", default="", help="service name to check ('' = the whole server)")
    parser.add_flag("--timeout", type=float, default=3.0, help="seconds")
    add_client_flags(parser, parser.add_flag, what="the node")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tls = ClientTls.from_args(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    except ValueError as err:
        parser.error(str(err))
    with channel(args.addr, tls) as ch:
        try:
            status = (
                health_pb2_grpc.HealthStub(ch)
                .Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
                .status
            )
        except grpc.RpcError as err:
            print(f"{args.addr}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(f"{args.addr}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
