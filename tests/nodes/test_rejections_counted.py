"""Every refusal counted exactly once in pdspec_requests_total, on real gRPC over loopback:
messages above the node's limit (unary and streamed requests, both nodes), calls that end
before their request message arrives (deadline, cancel), and validation errors whose status
never echoes an unbounded client value (a 100 KB request_id used to push the status's metadata
over gRPC's limit: RESOURCE_EXHAUSTED "metadata size exceeds" instead of the error)."""

from __future__ import annotations

import threading

import grpc
import pytest

from decode_node.server import DecodeNodeConfig
from decode_node.server import run_server as run_decode
from pdspec.tls import GRPC_DEFAULT_MAX_RECEIVE, transport_ceiling
from protos import pdspec_pb2
from protos.rpc import DECODE, DecodeStub
from protos.status import field_violations
from tests.nodes.conftest import cluster, wait_until

CODES = (
    "OK",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "UNAUTHENTICATED",
)
LIMIT = 4096


def counts(node) -> dict[str, float]:
    get = node.metrics.registry.get_sample_value
    return {code: get("pdspec_requests_total", {"node": node.metrics.node, "code": code}) for code in CODES}


def delta(node, before: dict[str, float]) -> dict[str, float]:
    return {code: value - before[code] for code, value in counts(node).items() if value != before[code]}


@pytest.fixture
def small_decode(pair):
    """A decode node whose message limit is 4 KiB (one per test: a call gRPC refused may be
    counted a moment after its client heard of it)."""
    config = DecodeNodeConfig(host="127.0.0.1", port=0, metrics_port=None, max_message_bytes=LIMIT)
    with run_decode(config, lambda: pair) as decode:
        yield decode


def oversized(size: int) -> pdspec_pb2.DecodeRequest:
    request = pdspec_pb2.DecodeRequest(request_id="big", prompt_token_ids=[1] * size)
    return request


def test_oversized_decode_messages_are_counted_once(small_decode):
    decode = small_decode
    with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as ch:
        stub = DecodeStub(ch)
        before = counts(decode)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(oversized(5000), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "above the limit 4096" in err.value.details()
        assert delta(decode, before) == {"RESOURCE_EXHAUSTED": 1}
        # A DecodeStream chunk over the limit: refused when the servicer reads it, counted by it.
        before = counts(decode)
        chunk = pdspec_pb2.DecodeChunk(request=oversized(5000))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.DecodeStream(iter([chunk]), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_until(lambda: delta(decode, before) == {"RESOURCE_EXHAUSTED": 1}, what="the stream counted")
        # Above gRPC's own ceiling (limit + 1 MiB here) the transport refuses the message and ends
        # the call, mostly before any Python code runs: RESOURCE_EXHAUSTED for the client, counted
        # at most once (docs/reliability.md: not reliably counted).
        before = counts(decode)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Decode(oversized(transport_ceiling(LIMIT) + 1), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in err.value.details()
        assert sum(delta(decode, before).values()) <= 3
        assert decode.engine.load == 0


def test_calls_that_end_before_their_request_arrives_are_counted(small_decode):
    """A client that opens a Decode call and never sends its message: the call ends by its
    deadline, or by a cancel, while the server waits for the message. gRPC never runs the
    servicer for such a call; the guard counts it."""
    decode = small_decode
    with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as ch:
        # The method's path as a request stream, so the client can hold its one message back.
        held = ch.stream_stream(
            DECODE,
            request_serializer=pdspec_pb2.DecodeRequest.SerializeToString,
            response_deserializer=pdspec_pb2.GenerateResponse.FromString,
        )
        release = threading.Event()

        def nothing():
            release.wait()
            return
            yield

        try:
            (guard,) = decode.shell.interceptors
            before = counts(decode)
            call = held(nothing(), timeout=3.0)
            wait_until(lambda: guard.waiting == 1, what="the server waiting for the message")
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: delta(decode, before) == {"DEADLINE_EXCEEDED": 1}, what="the expired call counted")
            before = counts(decode)
            call = held(nothing(), timeout=30)
            wait_until(lambda: guard.waiting == 1, what="the server waiting for the message")
            call.cancel()
            wait_until(lambda: delta(decode, before) == {"CANCELLED": 1}, what="the cancelled call counted")
            # A client that half-closes without the one message a Decode call takes.
            before = counts(decode)
            with pytest.raises(grpc.RpcError) as err:
                list(held(iter([]), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert delta(decode, before) == {"INVALID_ARGUMENT": 1}
        finally:
            release.set()
        assert decode.engine.load == 0


def test_validation_errors_do_not_echo_unbounded_input(pair):
    with cluster(pair) as (client, prefill, decode):
        addr = f"127.0.0.1:{prefill.port}"
        stub_prefill = client.stub
        for size in (7_000, 100_000):
            before = counts(prefill)
            request = pdspec_pb2.GenerateRequest(request_id="r" * size, prompt="import ", num_speculative_tokens=99)
            with pytest.raises(grpc.RpcError) as err:
                list(stub_prefill.Generate(request, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (size, err.value.details())
            trailing = sum(len(k) + len(v) for k, v in err.value.trailing_metadata())
            assert trailing < 2048, (size, trailing)
            assert f"({size} characters)" in err.value.details()
            assert {"request_id", "num_speculative_tokens"} <= set(dict(field_violations(err.value)))
            assert delta(prefill, before) == {"INVALID_ARGUMENT": 1}, addr
        # The decode node directly: a 100 KB id and a wrong fingerprint.
        with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as ch:
            before = counts(decode)
            request = pdspec_pb2.DecodeRequest(request_id="d" * 100_000, contract_fingerprint="x" * 100_000)
            with pytest.raises(grpc.RpcError) as err:
                list(DecodeStub(ch).Decode(request, timeout=10))
            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            assert sum(len(k) + len(v) for k, v in err.value.trailing_metadata()) < 4096
            assert delta(decode, before) == {err.value.code().name: 1}


def test_oversized_generate_request_is_counted_at_the_prefill_node(pair):
    with cluster(pair) as (client, prefill, _):
        before = counts(prefill)
        request = pdspec_pb2.GenerateRequest(prompt="x" * (GRPC_DEFAULT_MAX_RECEIVE + 10))
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert delta(prefill, before) == {"RESOURCE_EXHAUSTED": 1}
