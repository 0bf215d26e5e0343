import contextlib
import dataclasses
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_node.engine import DecodeConfig
from decode_node.server import DecodeNodeConfig
from decode_node.server import run_server as run_decode
from pdspec.client import Client
from prefill_node.engine import PrefillConfig
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill


def wait_until(predicate, timeout=10.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def drain(call) -> grpc.StatusCode:
    """A response stream read to its end: the status it ended with."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def stream_status(stub, chunks) -> tuple[grpc.StatusCode, dict[str, str]]:
    """A DecodeStream upload of `chunks` run to its end: its status and field violations."""
    from protos.status import field_violations

    try:
        list(stub.DecodeStream(iter(chunks), timeout=10))
    except grpc.RpcError as err:
        return err.code(), dict(field_violations(err))
    return grpc.StatusCode.OK, {}


def health_status(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                .status
            )
        except grpc.RpcError:
            return -1


@contextlib.contextmanager
def cluster(
    pair,
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
    decode_node: dict | None = None,
    client_options: dict | None = None,
    **prefill_node: object,
):
    """A decode and a prefill node on loopback, ports chosen by the OS, ready to serve;
    `prefill_node` overrides PrefillNodeConfig fields (http_port=0 for the OpenAI API...),
    `decode_node` DecodeNodeConfig fields (tls=...), `client_options` the Client's (tls_ca=...)."""
    decode_node_config = DecodeNodeConfig(
        host="127.0.0.1", port=0, metrics_port=0, engine=decode_config or DecodeConfig()
    )
    with run_decode(dataclasses.replace(decode_node_config, **(decode_node or {})), lambda: pair) as decode:
        config = PrefillNodeConfig(
            decode_addr=f"127.0.0.1:{decode.port}",
            host="127.0.0.1",
            port=0,
            metrics_port=0,
            engine=prefill_config or PrefillConfig(),
            peer_check_s=0.2,
        )
        config = dataclasses.replace(config, **prefill_node)
        with run_prefill(config, lambda: pair) as prefill:
            wait_until(lambda: prefill.peer.compatible, what="decode peer")
            with Client(f"127.0.0.1:{prefill.port}", **(client_options or {})) as client:
                yield client, prefill, decode


@pytest.fixture(scope="module")
def nodes(pair):
    with cluster(pair) as running:
        yield running
