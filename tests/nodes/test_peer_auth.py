"""The prefill->decode hop authenticated by a shared peer token (--peer-token-file), on real
gRPC over loopback: the prefill node sends it on every DecodeService call; the decode node
refuses calls without it (UNAUTHENTICATED, counted) while health and reflection stay open;
a prefill node with another token never reports SERVING."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from decode_node.server import SERVICE as DECODE_SERVICE
from pdspec import local
from pdspec.config import read_peer_token
from pdspec.tls import channel
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill
from protos import pdspec_pb2
from protos.rpc import DecodeStub
from tests.nodes.conftest import cluster, health_status, wait_until

TOKEN = "peer-token-0123456789abcdef"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def requests_total(node, code: str) -> float:
    return node.metrics.registry.get_sample_value("pdspec_requests_total", {"node": node.metrics.node, "code": code})


@pytest.fixture(scope="module")
def guarded(pair):
    with cluster(pair, decode_node={"peer_token": TOKEN}, peer_token=TOKEN) as running:
        yield running


def calls(stub: DecodeStub):
    """Every DecodeService method, each with a request the node would otherwise answer."""
    return {
        "GetInfo": lambda: stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=5),
        "Decode": lambda: list(stub.Decode(pdspec_pb2.DecodeRequest(request_id="x"), timeout=5)),
        "DecodeStream": lambda: list(stub.DecodeStream(iter([]), timeout=5)),
    }


def test_the_prefill_node_sends_the_token_and_requests_flow(guarded):
    client, prefill, decode = guarded
    before = requests_total(decode, "OK")
    out = client.generate("import ", seed=1, max_new_tokens=12)
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert requests_total(decode, "OK") - before == 1
    assert requests_total(decode, "UNAUTHENTICATED") == 0  # GetInfo checks and Decode all carried it
    assert health_status(prefill.port) == SERVING


def test_calls_without_the_right_token_are_unauthenticated_and_counted(guarded):
    _, _, decode = guarded
    addr = f"127.0.0.1:{decode.port}"
    before = requests_total(decode, "UNAUTHENTICATED")
    refused = 0
    for token in (None, "wrong-token-0123456789", TOKEN[:-1], TOKEN + "x", TOKEN.upper()):
        with channel(addr, None, api_key=token) as ch:
            for name, call in calls(DecodeStub(ch)).items():
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (token, name)
                assert "peer token" in err.value.details()
                refused += 1
    assert requests_total(decode, "UNAUTHENTICATED") - before == refused == 15
    assert decode.engine.load == 0
    # The right token on every kind of call the prefill node makes: past the guard, the node's
    # own answers (a real NodeInfo; validation errors for the empty requests).
    with channel(addr, None, api_key=TOKEN) as ch:
        answered = calls(DecodeStub(ch))
        assert answered["GetInfo"]().role == "decode"
        for name in ("Decode", "DecodeStream"):
            with pytest.raises(grpc.RpcError) as err:
                answered[name]()
            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), name
    # Health and reflection need no token.
    with grpc.insecure_channel(addr) as ch:
        for service in ("", DECODE_SERVICE):
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert DECODE_SERVICE in names
    assert requests_total(decode, "UNAUTHENTICATED") - before == 15


def test_pdspec_info_asks_a_guarded_decode_node_with_the_token(guarded, tmp_path, capsys):
    import json

    from pdspec import cli

    _, _, decode = guarded
    argv = ["info", "--node", "decode", "--decode-addr", f"127.0.0.1:{decode.port}"]
    assert cli.main(argv) == 1  # no token: UNAUTHENTICATED
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    path = tmp_path / "token"
    path.write_text(TOKEN)
    assert cli.main([*argv, "--peer-token-file", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["decode"]["role"] == "decode"


def test_a_prefill_node_with_another_token_never_serves(guarded, pair):
    _, _, decode = guarded
    config = PrefillNodeConfig(
        decode_addr=f"127.0.0.1:{decode.port}",
        host="127.0.0.1",
        port=0,
        metrics_port=None,
        peer_check_s=0.2,
        peer_token="another-token-0123456789",
    )
    before = requests_total(decode, "UNAUTHENTICATED")
    with run_prefill(config, lambda: pair) as prefill:
        wait_until(lambda: "UNAUTHENTICATED" in prefill.peer.problem, what="the peer check refused")
        assert not prefill.peer.compatible and health_status(prefill.port) == NOT_SERVING
    assert requests_total(decode, "UNAUTHENTICATED") > before


def test_peer_token_flags_and_environment(tmp_path, monkeypatch):
    from decode_node.__main__ import parse_args as decode_args
    from prefill_node.__main__ import parse_args as prefill_args

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert decode_args(["--peer-token-file", str(path)]).peer_token == TOKEN
    assert prefill_args(["--peer-token-file", str(path)]).peer_token == TOKEN
    assert decode_args([]).peer_token is None and prefill_args([]).peer_token is None  # a private network
    monkeypatch.setenv("PDSPEC_DECODE_PEER_TOKEN_FILE", str(path))
    monkeypatch.setenv("PDSPEC_PREFILL_PEER_TOKEN_FILE", str(path))
    assert decode_args([]).peer_token == prefill_args([]).peer_token == TOKEN
    for bad in ("", "short", "has a space in the middle of it", "tab\tinside-0123456789", "ünïcode-0123456789abc"):
        path.write_text(bad)
        with pytest.raises(SystemExit):
            decode_args([])
        with pytest.raises(ValueError, match="--peer-token-file"):
            read_peer_token(path)
    with pytest.raises(SystemExit):
        prefill_args(["--peer-token-file", str(tmp_path / "missing")])


def test_pdspec_serve_hands_both_nodes_one_private_token():
    with local.peer_token_file() as path:
        token = read_peer_token(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with local.peer_token_file() as other:
            assert read_peer_token(other) != token  # random per launch
    assert not Path(path).exists()
    args = local.parse_args(["--builtin"])
    decode, prefill = local.node_commands(args, path)
    for command in (decode, prefill):
        assert command[command.index("--peer-token-file") + 1] == str(path)
        assert not any(token in part for part in command)  # the token itself never on a command line
