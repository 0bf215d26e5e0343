"""Exit 0 iff a node answers grpc.health.v1 SERVING (the Docker HEALTHCHECK).

python -m pdspec.healthcheck [--addr localhost:50052] [--service NAME]
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addr", default="localhost:50052")
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.addr) as channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
                .status
            )
        except grpc.RpcError as err:
            print(f"{args.addr}: {err.code().name}", file=sys.stderr)
            return 1
    print(f"{args.addr}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
