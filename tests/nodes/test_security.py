"""Reliability and security of the nodes on real gRPC over loopback: TLS to the prefill node,
mTLS between prefill and decode (certificates from deploy/make-certs.sh), API keys on gRPC
and HTTP, unparseable requests, /metrics under idle connections, and a frozen decode node."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from decode_node.server import SERVICE as DECODE_SERVICE
from pdspec import cli, healthcheck
from pdspec.client import Client
from pdspec.tls import ClientTls, ServerTls, channel
from prefill_node.server import SERVICE as PREFILL_SERVICE
from prefill_node.server import PrefillNodeConfig, node_info
from prefill_node.server import run_server as run_prefill
from protos import pdspec_pb2, pdspec_pb2_grpc
from tests.nodes.conftest import cluster, health_status, wait_until
from tests.nodes.test_faults import free_port, start_decode

ROOT = Path(__file__).resolve().parents[2]
KEY = "s3cret-key"
GARBAGE = b"\x0a\xff"  # field 1, length-delimited, its length cut off: no message parses from it
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """Two independent sets from deploy/make-certs.sh: `a` (the cluster's) and `b` (another CA)."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("openssl not found: CI must run the TLS tests (deploy/make-certs.sh needs it)")
        # Outside CI only (CI fails above): a developer machine without openssl.
        pytest.skip("openssl is not installed (deploy/make-certs.sh needs it)")
    out = {}
    for name in ("a", "b"):
        path = tmp_path_factory.mktemp(f"certs-{name}")
        subprocess.run(["sh", str(ROOT / "deploy" / "make-certs.sh"), str(path)], check=True, capture_output=True)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def secure(pair, certs):
    """Decode with mTLS, prefill with TLS (gRPC and HTTP), an mTLS decode channel and an API key."""
    a = certs["a"]
    with cluster(
        pair,
        decode_node={"tls": ServerTls(a / "decode.pem", a / "decode-key.pem", a / "ca.pem")},
        tls=ServerTls(a / "prefill.pem", a / "prefill-key.pem"),
        decode_tls=ClientTls(a / "ca.pem", a / "client.pem", a / "client-key.pem"),
        api_key=KEY,
        http_port=0,
        client_options={"tls_ca": a / "ca.pem", "api_key": KEY},
    ) as running:
        yield running


def requests_total(node, code: str) -> float:
    return node.metrics.registry.get_sample_value("pdspec_requests_total", {"node": node.metrics.node, "code": code})


def decode_info(port: int, tls: ClientTls | None) -> pdspec_pb2.NodeInfo:
    with channel(f"127.0.0.1:{port}", tls) as ch:
        return pdspec_pb2_grpc.DecodeServiceStub(ch).GetInfo(pdspec_pb2.InfoRequest(), timeout=3)


def test_tls_round_trip_with_mtls_to_decode(secure, certs, capsys):
    client, prefill, decode = secure
    out = client.generate("import ", seed=1, max_new_tokens=8)  # client -TLS-> prefill -mTLS-> decode
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with Client(f"127.0.0.1:{prefill.port}") as plaintext, pytest.raises(grpc.RpcError) as err:
        plaintext.info(timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    ca = str(certs["a"] / "ca.pem")
    assert healthcheck.main(["--addr", f"127.0.0.1:{prefill.port}", "--tls-ca", ca]) == 0
    assert healthcheck.main(["--addr", f"127.0.0.1:{prefill.port}", "--timeout", "1"]) == 1  # plaintext to TLS
    client_cert = ["--tls-cert", str(certs["a"] / "client.pem"), "--tls-key", str(certs["a"] / "client-key.pem")]
    assert healthcheck.main(["--addr", f"127.0.0.1:{decode.port}", "--tls-ca", ca, *client_cert]) == 0
    assert healthcheck.main(["--addr", f"127.0.0.1:{decode.port}", "--tls-ca", ca, "--timeout", "1"]) == 1
    argv = ["--prefill-addr", f"127.0.0.1:{prefill.port}", "--tls-ca", ca, "--api-key", KEY]
    assert cli.main(["generate", *argv, "--max-new-tokens", "4", "--seed", "1", "import "]) == 0
    assert "[finished: length]" in capsys.readouterr().out
    info = ["info", *argv, "--decode-addr", f"127.0.0.1:{decode.port}", *client_cert]
    assert cli.main(info) == 0
    assert json.loads(capsys.readouterr().out)["decode"]["role"] == "decode"
    https = ssl.create_default_context(cafile=ca)
    response = httpx.post(
        f"https://127.0.0.1:{prefill.http_port}/v1/completions",
        json={"prompt": "import ", "max_tokens": 4, "seed": 1},
        headers={"Authorization": f"Bearer {KEY}"},
        verify=https,
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_mtls_decode_refuses_clients_without_a_certificate_of_its_ca(secure, certs):
    _, _, decode = secure
    a, b = certs["a"], certs["b"]
    good = ClientTls(a / "ca.pem", a / "client.pem", a / "client-key.pem")
    assert decode_info(decode.port, good).role == "decode"
    assert decode_info(decode.port, ClientTls(a / "ca.pem", a / "client.pem", a / "client-key.pem", "decode")).role
    refused = {
        "plaintext": None,
        "no client certificate": ClientTls(a / "ca.pem"),
        "a certificate of another CA": ClientTls(a / "ca.pem", b / "client.pem", b / "client-key.pem"),
        "a server certificate of another CA": ClientTls(b / "ca.pem", b / "client.pem", b / "client-key.pem"),
        "a name not in the server's SAN": ClientTls(a / "ca.pem", a / "client.pem", a / "client-key.pem", "nope"),
    }
    for what, tls in refused.items():
        with pytest.raises(grpc.RpcError) as err:
            decode_info(decode.port, tls)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what


def test_api_key_on_grpc_and_http(secure, certs):
    _, prefill, _ = secure
    a = certs["a"]
    addr = f"127.0.0.1:{prefill.port}"
    before = requests_total(prefill, "UNAUTHENTICATED")
    for key in (None, "wrong", KEY[:-1], KEY + "x"):
        with Client(addr, tls_ca=a / "ca.pem", api_key=key) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate("import ", max_new_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
            with pytest.raises(grpc.RpcError) as err:
                client.info()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
    assert requests_total(prefill, "UNAUTHENTICATED") - before == 8
    with channel(addr, ClientTls(a / "ca.pem")) as ch:  # no key: health and reflection stay open
        for service in ("", PREFILL_SERVICE):
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
            assert status.status == SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=3
        )
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert PREFILL_SERVICE in names
    base, https = f"https://127.0.0.1:{prefill.http_port}", ssl.create_default_context(cafile=str(a / "ca.pem"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(f"{base}/v1/models", headers=headers, verify=https)
        assert response.status_code == 401, headers
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, verify=https).status_code == 200
    assert httpx.get(f"{base}/health", verify=https).status_code == 200


def test_unparseable_requests_are_invalid_argument_and_counted(secure, certs):
    _, prefill, decode = secure
    a = certs["a"]
    cases = [
        (prefill, f"/{PREFILL_SERVICE}/Generate", ClientTls(a / "ca.pem"), KEY),
        (decode, f"/{DECODE_SERVICE}/Decode", ClientTls(a / "ca.pem", a / "client.pem", a / "client-key.pem"), None),
    ]
    for node, method, tls, key in cases:
        before = requests_total(node, "INVALID_ARGUMENT")
        with channel(f"127.0.0.1:{node.port}", tls, api_key=key) as ch:
            call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                list(call(GARBAGE, timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert "unparseable" in err.value.details() or "well-formed protobuf" in err.value.details()
        assert requests_total(node, "INVALID_ARGUMENT") - before == 1, method
    with Client(f"127.0.0.1:{prefill.port}", tls_ca=a / "ca.pem") as keyless:  # auth first: garbage unparsed
        call = keyless.channel.unary_stream(f"/{PREFILL_SERVICE}/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(call(GARBAGE, timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_metrics_endpoint_keeps_one_thread_under_idle_connections(secure):
    _, prefill, decode = secure
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for port in (prefill.metrics_port, decode.metrics_port)]
    idle += [socket.create_connection(("127.0.0.1", prefill.metrics_port)) for _ in range(99)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - threads < 5  # prometheus_client's server: +101
        started = time.monotonic()
        text = httpx.get(f"http://127.0.0.1:{prefill.metrics_port}/metrics", timeout=5).text
        assert "pdspec_requests_total" in text and time.monotonic() - started < 2
    finally:
        for sock in idle:
            sock.close()


class SilentDecode(pdspec_pb2_grpc.DecodeServiceServicer):
    """A decode node that is alive (answers pings and GetInfo) but stops sending after one
    message: what only the relay's watchdog catches."""

    def __init__(self) -> None:
        self.info: pdspec_pb2.NodeInfo | None = None

    def GetInfo(self, request, context):
        if self.info is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not ready")
        return self.info

    def Decode(self, request, context):
        yield pdspec_pb2.GenerateResponse(request_id=request.request_id, token_ids=[request.first_token_id])
        while context.is_active():
            time.sleep(0.05)


def test_relay_watchdog_cancels_a_silent_decode_stream(pair):
    from concurrent import futures

    silent = SilentDecode()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pdspec_pb2_grpc.add_DecodeServiceServicer_to_server(silent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    config = PrefillNodeConfig(  # --decode-stall-seconds: the default 3
        decode_addr=f"127.0.0.1:{port}", host="127.0.0.1", port=0, metrics_port=None, peer_check_s=0.2
    )
    try:
        with run_prefill(config, lambda: pair) as prefill, Client(f"127.0.0.1:{prefill.port}") as client:
            silent.info = pdspec_pb2.NodeInfo()
            silent.info.CopyFrom(node_info(prefill.engine, config))
            wait_until(lambda: prefill.peer.compatible, what="silent decode compatible")
            changes, on_change = [], prefill.peer.on_change
            prefill.peer.on_change = lambda ok: (changes.append((time.monotonic(), ok)), on_change(ok))
            stream = client.stream("import ", max_new_tokens=50, seed=1)
            next(stream)  # prefill's first token
            next(stream)  # decode's one message
            silenced = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                next(stream)
            ended = time.monotonic() - silenced
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "stalled" in err.value.details()
            assert 2.9 < ended < 4, ended
            wait_until(lambda: len(changes) >= 2, what="NOT_SERVING, then SERVING after the re-check")
            assert [ok for _, ok in changes[:2]] == [False, True]
            assert changes[0][0] - silenced < 4  # NOT_SERVING at the stall, not a GetInfo timeout later
            print(f"silent decode: UNAVAILABLE after {ended:.2f}s, NOT_SERVING after {changes[0][0] - silenced:.2f}s")
    finally:
        server.stop(0)


def stream_outcome(stream, out: dict) -> None:
    try:
        for _ in stream:
            pass
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as err:
        out["code"] = err.code()
    out["at"] = time.monotonic()


def test_frozen_decode_node(pair):
    """SIGSTOP mid-stream: the client hears UNAVAILABLE and prefill goes NOT_SERVING within 5 s
    (the channel's ping timeout, 2 s after the last ping, beats the 3 s watchdog; node b runs
    without the watchdog: keepalive alone); SIGCONT, or a restart after a long outage:
    SERVING again within 2 s (default config)."""
    port = free_port()
    decode = start_decode(port)
    base = PrefillNodeConfig(decode_addr=f"127.0.0.1:{port}", host="127.0.0.1", port=0, metrics_port=None)
    watched = base  # --decode-stall-seconds 3 (the default)
    keepalive_only = PrefillNodeConfig(**{**base.__dict__, "decode_stall_s": 0})
    try:
        with (
            run_prefill(watched, lambda: pair) as a,
            run_prefill(keepalive_only, lambda: pair) as b,
            Client(f"127.0.0.1:{a.port}") as client_a,
            Client(f"127.0.0.1:{b.port}") as client_b,
        ):
            nodes = (a, b)
            wait_until(lambda: a.peer.compatible and b.peer.compatible, timeout=60, what="decode subprocess up")
            streams = [c.stream("import ", max_new_tokens=4096, seed=1, timeout=60) for c in (client_a, client_b)]
            for stream in streams:
                for _ in range(3):
                    next(stream)
            outcomes = [{}, {}]
            readers = [
                threading.Thread(target=stream_outcome, args=(s, o)) for s, o in zip(streams, outcomes, strict=True)
            ]
            decode.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            for reader in readers:
                reader.start()
            not_serving = {}
            while len(not_serving) < 2 and time.monotonic() - frozen < 8:
                for name, node in zip("ab", nodes, strict=True):
                    if name not in not_serving and health_status(node.port) == NOT_SERVING:
                        not_serving[name] = time.monotonic() - frozen
                time.sleep(0.05)
            for reader in readers:
                reader.join(10)
            ended = {
                name: (o.get("code"), round(o.get("at", 99) - frozen, 2))
                for name, o in zip("ab", outcomes, strict=True)
            }
            print(f"frozen decode: streams ended {ended}, NOT_SERVING after {not_serving}")
            for name, (code, after) in ended.items():
                assert code == grpc.StatusCode.UNAVAILABLE and after < 5, (name, ended)
            assert set(not_serving) == {"a", "b"} and max(not_serving.values()) < 5, not_serving
            with pytest.raises(grpc.RpcError) as err:  # while frozen: refused at once, not hung
                client_a.generate("def ", max_new_tokens=4, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            decode.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
            wait_until(lambda: all(health_status(n.port) == SERVING for n in nodes), timeout=10, what="SERVING")
            after_sigcont = time.monotonic() - resumed
            assert len(client_a.generate("def ", max_new_tokens=4).token_ids) == 4

            decode.kill()
            decode.wait()
            time.sleep(6)  # gRPC's default backoff would wait ~4 s more by now
            decode = start_decode(port)
            wait_until(lambda: health_status(port) == SERVING, timeout=60, what="decode restarted")
            ready = time.monotonic()
            wait_until(lambda: all(health_status(n.port) == SERVING for n in nodes), timeout=10, what="SERVING")
            after_restart = time.monotonic() - ready
            print(f"SERVING {after_sigcont:.2f}s after SIGCONT, {after_restart:.2f}s after the restart")
            assert after_sigcont < 2 and after_restart < 2
            assert len(client_b.generate("def ", max_new_tokens=4).token_ids) == 4
    finally:
        decode.send_signal(signal.SIGCONT)
        decode.kill()
        decode.wait()


def test_prefill_mtls_covers_grpc_and_http(pair, certs):
    a, b = certs["a"], certs["b"]
    mine = {"tls_ca": a / "ca.pem", "tls_cert": a / "client.pem", "tls_key": a / "client-key.pem"}
    tls = ServerTls(a / "prefill.pem", a / "prefill-key.pem", a / "ca.pem")
    with cluster(pair, tls=tls, http_port=0, client_options=mine) as (client, prefill, _):
        assert len(client.generate("import ", max_new_tokens=3).token_ids) == 3
        for other in (
            {"tls_ca": a / "ca.pem"},
            {**mine, "tls_cert": b / "client.pem", "tls_key": b / "client-key.pem"},
        ):
            with Client(f"127.0.0.1:{prefill.port}", **other) as refused, pytest.raises(grpc.RpcError) as err:
                refused.info(timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        url = f"https://127.0.0.1:{prefill.http_port}/health"
        https = ssl.create_default_context(cafile=str(a / "ca.pem"))
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            httpx.get(url, verify=https).raise_for_status()
        https.load_cert_chain(a / "client.pem", a / "client-key.pem")
        assert httpx.get(url, verify=https).status_code == 200


def test_security_flags_parse_into_the_node_configs(tmp_path, monkeypatch):
    from decode_node.__main__ import parse_args as decode_args
    from prefill_node.__main__ import parse_args as prefill_args

    key = tmp_path / "key"
    key.write_text("from-a-file\n")
    monkeypatch.setenv("PDSPEC_PREFILL_DECODE_TLS_CA", "/c/ca.pem")
    argv = "--tls-cert /c/p.pem --tls-key /c/p-key.pem --decode-tls-cert /c/client.pem"
    argv += " --decode-tls-key /c/client-key.pem --decode-tls-server-name decode --decode-stall-seconds 1.5"
    config = prefill_args([*argv.split(), "--api-key-file", str(key)])
    assert config.tls == ServerTls(Path("/c/p.pem"), Path("/c/p-key.pem")) and config.api_key == "from-a-file"
    assert config.decode_tls == ClientTls(Path("/c/ca.pem"), Path("/c/client.pem"), Path("/c/client-key.pem"), "decode")
    assert config.decode_stall_s == 1.5 and prefill_args([]).decode_stall_s == 3.0
    monkeypatch.delenv("PDSPEC_PREFILL_DECODE_TLS_CA")
    assert prefill_args([]).tls is None and prefill_args([]).decode_tls is None
    decode = decode_args(["--tls-cert", "d.pem", "--tls-key", "d-key.pem", "--tls-ca", "ca.pem"])
    assert decode.tls.mutual and decode.tls.ca == Path("ca.pem")
    for bad in (["--tls-cert", "d.pem"], ["--tls-ca", "ca.pem"]):
        with pytest.raises(SystemExit):
            decode_args(bad)
    with pytest.raises(SystemExit):
        prefill_args(["--decode-tls-cert", "c.pem"])
