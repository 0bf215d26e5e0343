"""In-process nodes on loopback for the bench scripts (bench/findings.py): a decode and a
prefill node ready to serve, a stream read on its own thread, a decode subprocess.

bench's own copy of what tests/nodes/conftest.py and tests/nodes/test_reliability.py use:
bench does not import tests (nor tests bench)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import threading
import time

import grpc

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


@contextlib.contextmanager
def cluster(
    pair, decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig | None = None, **prefill_node
):
    """A decode and a prefill node on loopback, ports chosen by the OS, ready to serve;
    `prefill_node` overrides PrefillNodeConfig fields (metrics_port=0...)."""
    decode_node_config = DecodeNodeConfig(
        host="127.0.0.1", port=0, metrics_port=0, engine=decode_config or DecodeConfig()
    )
    with run_decode(decode_node_config, lambda: pair) as decode:
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
            with Client(f"127.0.0.1:{prefill.port}") as client:
                yield client, prefill, decode


class Reader:
    """A stream read on its own thread: first-message time, tokens, final status."""

    def __init__(self, stream, started: float | None = None) -> None:
        self.stream, self.started = stream, started or time.monotonic()
        self.first_at: float | None = None
        self.messages = 0
        self.tokens: list[int] = []
        self.code: grpc.StatusCode | None = None
        self.finish_reason = ""
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for response in self.stream:
                self.messages += 1
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self.tokens += response.token_ids
                if response.finished:
                    self.finish_reason = response.finish_reason
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            self.code = err.code()
        self.ended_at = time.monotonic()

    def cancel(self) -> None:
        self.stream.cancel()

    def join(self, timeout: float = 30) -> Reader:
        self.thread.join(timeout)
        return self


def start_decode(port: int, *flags: str) -> subprocess.Popen:
    """`python -m decode_node` on 127.0.0.1:`port`, no metrics port, output discarded."""
    command = [sys.executable, "-m", "decode_node", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(
        [*command, "--metrics-port", "-1", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
