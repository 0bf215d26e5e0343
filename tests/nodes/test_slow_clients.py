"""A client that stops reading behind the prefill node is paused: the decode node stops
generating for it within a bound derived from the buffers between the two, over gRPC and
over the OpenAI HTTP stream, and once the client reads again the stream resumes and ends with
the tokens of an uninterrupted seeded run.

What may be generated beyond what the client read (prefill_node/server.py RELAY_WINDOW,
prefill_node/http.py RELAY_CREDIT and SEND_BUFFER_BYTES, decode_node/fairness.py): the decode
node's backlog of `pause_backlog` events (and the one the engine delivers as it pauses), the
message its servicer is sending; the messages the prefill node's 1 KiB receive window on its
decode channel holds; the one its relay holds; and what the client leg buffers: the client's own
HTTP/2 window (gRPC), or its socket receive buffer plus the HTTP server's bounded write buffer
and unsent socket bytes (HTTP). A message coalesces what waited in the backlog: at most
`pause_backlog + 1` events of one token each (K = 0).

pause_backlog is 1 here, so a window of W bytes holds at most 2 W / (the smallest message)
tokens, a bound tight enough to tell the fix from the read-ahead it replaced (a whole stream:
the requests' max_new_tokens)."""

from __future__ import annotations

import json
import re
import socket

import grpc
import pytest

from decode_node.engine import DecodeConfig
from prefill_node.http import RELAY_CREDIT, SEND_BUFFER_BYTES
from prefill_node.server import RELAY_WINDOW_BYTES
from protos import pdspec_pb2, pdspec_pb2_grpc
from tests.nodes.conftest import cluster, wait_until

BACKLOG = 1
# Engine steps without a token for the stream: it has stopped growing. A paused engine steps
# ~100 times a second, so the stream waits on its client longer than STALL_S: the relay watchdog
# must not take that for a stalled decode node (it would end the stream UNAVAILABLE).
SETTLED_STEPS = 120
STALL_S = 1.0
PROMPT = "import "
# Every gRPC message carries the request id: a long one makes each message large, so a window of
# a few KiB holds few of them.
RID = "slow-" + "x" * 200
CLIENT_WINDOW = 1024  # the gRPC client's receive window (no BDP probing: it stays this size)
CLIENT_RCVBUF = 2048  # the HTTP client's socket receive buffer (Linux doubles it)
GRPC_TOKENS = 100
HTTP_TOKENS = 450


@pytest.fixture(scope="module")
def nodes(pair):
    config = DecodeConfig(max_batch=4, pause_backlog=BACKLOG, preempt_after_steps=0)
    with cluster(pair, config, http_port=0, decode_stall_s=STALL_S) as running:
        yield running


def _stopped(decode) -> int:
    """Waits until the only stream is paused and the engine has stepped SETTLED_STEPS times since
    its count last grew; its generated tokens."""
    seen: dict[str, int] = {}

    def settled() -> bool:
        with decode.engine._lock:
            active = list(decode.engine._active)
        assert active, "the stream ran to its end while its client read nothing: nothing paused it"
        (request,) = active
        generated, steps = request.seq.generated, decode.engine.fairness.steps
        if seen.get("generated") != generated:
            seen.update(generated=generated, since=steps)
        return decode.engine.fairness.paused(request) and steps - seen["since"] >= SETTLED_STEPS

    wait_until(settled, what="the stream to stop growing")
    return seen["generated"]


def _messages(window: int, smallest: int) -> int:
    """Messages of at least `smallest` bytes that `window` bytes of buffer hold: those within
    it, one across its edge, and one past it (a gRPC reader waiting for a message is granted
    the window that message needs)."""
    return window // smallest + 2


def _decode_messages(smallest: int) -> int:
    """Messages on the decode leg: the backlog, the one decode is sending, what the prefill
    node's receive window holds and the one its relay hands on."""
    return 1 + 1 + _messages(RELAY_WINDOW_BYTES, smallest) + 1


def _tokens(messages: int) -> int:
    """The most tokens `messages` messages carry: each coalesces at most the backlog and the
    event the engine delivered as it paused."""
    return messages * (BACKLOG + 1)


def test_a_grpc_client_that_stops_reading_is_paused_and_resumes(nodes):
    _, prefill, decode = nodes
    request = pdspec_pb2.GenerateRequest(
        request_id=RID,
        prompt=PROMPT,
        num_speculative_tokens=0,
        sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=5, max_new_tokens=GRPC_TOKENS),
    )
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", CLIENT_WINDOW)]
    with grpc.insecure_channel(f"127.0.0.1:{prefill.port}", options=options) as channel:
        stub = pdspec_pb2_grpc.PrefillServiceStub(channel)
        whole = [t for response in stub.Generate(request, timeout=30) for t in response.token_ids]
        assert len(whole) == GRPC_TOKENS
        stream = stub.Generate(request, timeout=30)
        tokens = [t for _ in range(3) for t in next(stream).token_ids]
        generated = _stopped(decode)
        # the smallest message on either leg: the request id and one token
        smallest = pdspec_pb2.GenerateResponse(request_id=RID, token_ids=[0]).ByteSize() + 5  # + gRPC's prefix
        bound = len(tokens) + _tokens(_decode_messages(smallest) + _messages(CLIENT_WINDOW, smallest))
        print(f"gRPC: read {len(tokens)}, generated {generated} (bound {bound}) of {GRPC_TOKENS}")
        assert generated <= bound < GRPC_TOKENS - 1  # the first token is the prefill node's
        tokens += [t for response in stream for t in response.token_ids]
    assert tokens == whole
    assert prefill.peer.compatible  # never suspected
    wait_until(lambda: decode.engine.load == 0, what="decode idle")


def _sse_texts(raw: bytes) -> list[str]:
    """The completion chunks' texts in a server-sent event stream (chunked transfer coding: the
    server writes each event as one chunk, so none is split)."""
    return [json.loads(m)["choices"][0]["text"] for m in re.findall(rb"data: (\{.*?\})\n\n", raw)]


def test_an_http_stream_that_stops_reading_is_paused_and_resumes(nodes):
    _, prefill, decode = nodes
    body = json.dumps(
        {
            "model": prefill.http.api.model,
            "prompt": PROMPT,
            "max_tokens": HTTP_TOKENS,
            "temperature": 1.0,
            "seed": 5,
            "num_speculative_tokens": 0,
            "stream": True,
        }
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )

    def stream() -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
        sock.connect(("127.0.0.1", prefill.http_port))
        sock.sendall(head.encode() + body)
        return sock

    def rest(sock: socket.socket, raw: bytes) -> bytes:
        while data := sock.recv(1 << 16):
            raw += data
        sock.close()
        return raw

    whole = "".join(_sse_texts(rest(stream(), b"")))
    sock = stream()
    raw = b""
    while raw.count(b"data: {") < 4:  # the first few events, read a little at a time
        raw += sock.recv(256)
    generated = _stopped(decode)
    first = re.search(rb"data: (\{.*?\})\n\n", raw)
    assert first is not None
    chunk = json.loads(first.group(1))
    smallest = len(first.group(0)) - len(json.dumps(chunk["choices"][0]["text"]).encode()) + len(b'""')
    rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    # what the client leg holds: the client's receive buffer, in flight (the client's window, at
    # most that buffer), the server's write buffer (an event past its mark: _messages' edge) and
    # unsent socket bytes (the low-water mark, and one segment, at most half the client's window)
    http_bytes = 2 * rcvbuf + 2 * SEND_BUFFER_BYTES + rcvbuf // 2
    relay = RELAY_CREDIT + 1  # queued for the event loop, and the one waiting to be
    bound = raw.count(b"data: {") + _tokens(_decode_messages(smallest) + relay + _messages(http_bytes, smallest))
    print(f"HTTP: read ~{raw.count(b'data: {')}, generated {generated} (bound {bound}) of {HTTP_TOKENS}")
    assert generated <= bound < HTTP_TOKENS - 1
    assert "".join(_sse_texts(rest(sock, raw))) == whole
    assert prefill.peer.compatible  # never suspected
    wait_until(lambda: decode.engine.load == 0, what="decode idle")


def test_http_connections_send_small_writes_at_once(nodes):
    """Every connection of the OpenAI API has Nagle's algorithm off (TCP_NODELAY): with it on, an
    event stream's chunk written while the one before is unacknowledged waits for a client's
    delayed ACK (~40 ms), and a kept-alive connection got its stream in one late burst."""
    _, prefill, _ = nodes
    with socket.create_connection(("127.0.0.1", prefill.http_port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 ")
        connections = list(prefill.http.server.server_state.connections)  # this one, kept alive
        sockets = [c.transport.get_extra_info("socket") for c in connections]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
