"""A decode node that dies mid-stream: the client hears UNAVAILABLE within 5 s, the prefill
node keeps serving (NOT_SERVING while the peer is gone) and recovers when it returns."""

import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pdspec.client import Client
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill
from tests.nodes.conftest import health_status, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_decode(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "decode_node", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def decode_port():
    return free_port()


def test_decode_killed_mid_stream(pair, decode_port):
    decode = start_decode(decode_port)
    config = PrefillNodeConfig(
        decode_addr=f"127.0.0.1:{decode_port}", host="127.0.0.1", port=0, metrics_port=None, peer_check_s=0.2
    )
    try:
        with run_prefill(config, lambda: pair) as prefill, Client(f"127.0.0.1:{prefill.port}") as client:
            wait_until(lambda: prefill.peer.compatible, timeout=60, what="decode subprocess up")
            stream = client.stream("import ", max_new_tokens=4096, seed=1, timeout=60)
            for _ in range(5):
                next(stream)
            decode.kill()
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - killed < 5
            wait_until(
                lambda: health_status(prefill.port) == health_pb2.HealthCheckResponse.NOT_SERVING,
                what="prefill NOT_SERVING without its peer",
            )
            with pytest.raises(grpc.RpcError) as err:
                client.generate("def ", max_new_tokens=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            decode.wait()
            decode = start_decode(decode_port)
            wait_until(
                lambda: health_status(prefill.port) == health_pb2.HealthCheckResponse.SERVING,
                timeout=60,
                what="prefill SERVING again",
            )
            assert len(client.generate("def ", max_new_tokens=5).token_ids) == 5
    finally:
        decode.kill()
        decode.wait()
