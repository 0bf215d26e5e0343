"""Both nodes over real gRPC on loopback."""

import threading
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from decode_node.engine import DecodeConfig
from engine.spec_config import SpeculativeConfig
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.proposal import ProposalEncoding
from protos.status import field_violations
from sampling.proposal import DraftLaw
from tests.nodes.conftest import cluster, health_status, wait_until

PROMPTS = ["def main():\n    ", "import ", "class Foo(", "for i in range("]


def test_greedy_output_with_k4_equals_k0(nodes):
    client, _, _ = nodes
    for prompt in PROMPTS:
        spec = client.generate(prompt, greedy=True, max_new_tokens=48, num_speculative_tokens=4)
        plain = client.generate(prompt, greedy=True, max_new_tokens=48, num_speculative_tokens=0)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert len(spec.token_ids) == 48 and spec.finish_reason == "length"
        assert spec.stats.verify_steps > 0 and plain.stats.verify_steps == 0


def test_seeded_stochastic_output_is_reproducible(nodes):
    client, _, _ = nodes
    runs = [client.generate("import ", seed=42, max_new_tokens=40, temperature=0.9, top_p=0.95) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 40
    other = client.generate("import ", seed=43, max_new_tokens=40, temperature=0.9, top_p=0.95)
    assert other.token_ids != runs[0].token_ids


@pytest.mark.parametrize(
    ("encoding", "law"),
    [
        (ProposalEncoding.DENSE, DraftLaw.STOCHASTIC),
        (ProposalEncoding.SPARSE, DraftLaw.STOCHASTIC),
        (ProposalEncoding.POINT_MASS, DraftLaw.POINT_MASS),
    ],
)
def test_every_encoding_end_to_end(pair, encoding, law):
    with cluster(
        pair,
        DecodeConfig(spec=SpeculativeConfig(draft_law=law)),
        PrefillConfig(spec=SpeculativeConfig(draft_law=law), proposal_encoding=encoding),
    ) as (
        client,
        prefill,
        _,
    ):
        out = client.generate("def ", seed=7, max_new_tokens=30)
        assert len(out.token_ids) == 30
        sent = prefill.metrics.proposal_bytes.labels("prefill", encoding.value)._value.get()
        assert sent > 0


def test_first_message_is_the_first_token_and_text_is_complete(nodes):
    client, _, _ = nodes
    responses = list(client.stream("x = 'caf", seed=3, max_new_tokens=20))
    assert len(responses[0].token_ids) == 1 and not responses[0].finished
    assert responses[-1].finished and responses[-1].finish_reason == "length"
    tokens = [t for r in responses for t in r.token_ids]
    assert "".join(r.text for r in responses) == bytes(t for t in tokens if t < 256).decode("utf-8", "replace")


def test_stop_token_and_max_new_tokens_1(nodes):
    client, _, _ = nodes
    out = client.generate("def ", greedy=True, max_new_tokens=1)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    greedy = client.generate("def main():\n    ", greedy=True, max_new_tokens=30)
    stop = greedy.token_ids[5]
    stopped = client.generate("def main():\n    ", greedy=True, max_new_tokens=30, stop_token_ids=[stop])
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop
    assert stopped.token_ids == greedy.token_ids[: len(stopped.token_ids)]


def test_32_concurrent_streams_equal_their_solo_runs(nodes):
    client, _, _ = nodes
    solo = {seed: client.generate(PROMPTS[seed % 4], seed=seed, max_new_tokens=24).token_ids for seed in range(32)}
    results = {}

    def run(seed):
        results[seed] = client.generate(PROMPTS[seed % 4], seed=seed, max_new_tokens=24).token_ids

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo


def test_bad_generate_requests_are_invalid_argument(nodes):
    client, _, _ = nodes
    cases = [
        ({"prompt": None}, "prompt"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": None, "prompt_token_ids": [300]}, "prompt_token_ids"),
        ({"prompt": "x", "temperature": -1.0}, "sampling.temperature"),
        ({"prompt": "x", "top_p": 2.0}, "sampling.top_p"),
        ({"prompt": "x", "max_new_tokens": -2}, "sampling.max_new_tokens"),
        ({"prompt": "x", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ]
    for kwargs, field in cases:
        prompt = kwargs.pop("prompt")
        with pytest.raises(grpc.RpcError) as err:
            client.generate(prompt, request_id="bad-1", **kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert "bad-1" in err.value.details()
        assert field in dict(field_violations(err.value)), (kwargs, err.value.details())
    assert len(client.generate("x", max_new_tokens=5).token_ids) == 5  # still serving


def test_bad_decode_requests_through_the_running_decode_node(nodes):
    _, prefill, decode = nodes
    request = pdspec_pb2.GenerateRequest(
        request_id="d",
        prompt="import ",
        num_speculative_tokens=3,
        sampling=pdspec_pb2.SamplingParams(do_sample=True, max_new_tokens=10),
    )
    # DENSE explicitly (the default for this point-mass law is POINT_MASS): probs to mutate
    engine = PrefillEngine(
        prefill.engine.pair, replace(prefill.engine.config, proposal_encoding=ProposalEncoding.DENSE)
    )
    good = engine.prefill(engine.check(request)).decode_request
    stub = pdspec_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
    mutations = {
        "protocol_version": (lambda r: setattr(r, "protocol_version", 9), grpc.StatusCode.FAILED_PRECONDITION),
        "contract_fingerprint": (
            lambda r: setattr(r, "contract_fingerprint", "sha256:x"),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        "proposal.encoding": (lambda r: setattr(r.proposal, "encoding", 0), grpc.StatusCode.INVALID_ARGUMENT),
        "proposal.probs.data": (
            lambda r: setattr(r.proposal.probs, "data", r.proposal.probs.data[:-4]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "proposal.token_ids": (lambda r: r.proposal.token_ids.append(1), grpc.StatusCode.INVALID_ARGUMENT),
        "first_token_id": (lambda r: setattr(r, "first_token_id", 999), grpc.StatusCode.INVALID_ARGUMENT),
        "num_speculative_tokens": (
            lambda r: setattr(r, "num_speculative_tokens", 50),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    }
    for field, (mutate, code) in mutations.items():
        bad = pdspec_pb2.DecodeRequest()
        bad.CopyFrom(good)
        mutate(bad)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(bad, timeout=5))
        assert err.value.code() == code, field
        assert field in dict(field_violations(err.value)), field
    assert decode.engine.load == 0  # no state touched
    assert len([t for r in stub.Decode(good, timeout=5) for t in r.token_ids]) == 9
    rejected = decode.metrics.validation_rejections.labels("decode", "contract_fingerprint")._value.get()
    assert rejected >= 1


def test_oversized_message_is_resource_exhausted(pair):
    from decode_node.server import DecodeNodeConfig, run_server

    with run_server(
        DecodeNodeConfig(host="127.0.0.1", port=0, metrics_port=None, max_message_bytes=2048), lambda: pair
    ) as decode:
        stub = pdspec_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
        request = pdspec_pb2.DecodeRequest(request_id="big", prompt_token_ids=[1] * 5000)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(request, timeout=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_full_queue_is_resource_exhausted(pair):
    with cluster(pair, DecodeConfig(max_batch=1, max_queue=0)) as (client, _, decode):
        stream = client.stream("import ", max_new_tokens=2000, seed=1, timeout=30)
        next(stream)  # the first token: the request now sits in the decode node's only slot
        wait_until(lambda: decode.engine.load == 1, what="slot taken")
        with pytest.raises(grpc.RpcError) as err:
            client.generate("def ", max_new_tokens=50, seed=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream.cancel()
        wait_until(lambda: decode.engine.load == 0, what="slot freed")
        assert len(client.generate("def ", max_new_tokens=5).token_ids) == 5


def test_client_cancel_frees_the_decode_slot(nodes):
    client, _, decode = nodes
    stream = client.stream("import ", max_new_tokens=4096, seed=5, timeout=30)
    next(stream)
    next(stream)
    wait_until(lambda: decode.engine.load == 1, what="request in the batch")
    stream.cancel()
    wait_until(lambda: decode.engine.load == 0, what="slot freed after cancel")


def test_no_client_deadline_runs_to_the_end(nodes):
    """No deadline is the default of grpc-js, grpcurl and grpc Python: such a request must run
    to its end, not inherit an overflowed timeout on the relayed decode call."""
    client, _, decode = nodes
    out = client.generate("import ", seed=11, max_new_tokens=60, timeout=None)
    assert len(out.token_ids) == 60 and out.finish_reason == "length"
    request = pdspec_pb2.GenerateRequest(
        request_id="raw-stub",
        prompt="def ",
        num_speculative_tokens=4,
        sampling=pdspec_pb2.SamplingParams(do_sample=False, max_new_tokens=30),
    )
    responses = list(pdspec_pb2_grpc.PrefillServiceStub(client.channel).Generate(request))
    assert responses[-1].finished and responses[-1].finish_reason == "length"
    assert sum(len(r.token_ids) for r in responses) == 30
    wait_until(lambda: decode.engine.load == 0, what="slots free")


def test_deadline_is_honoured(nodes):
    client, _, decode = nodes
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.generate("import ", max_new_tokens=4096, seed=9, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3
    wait_until(lambda: decode.engine.load == 0, what="slot freed after deadline")


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_equal_the_sums_of_request_stats(pair):
    with cluster(pair) as (client, prefill, decode):
        before = scrape(decode.metrics_port)
        for name in ("pdspec_spec_verify_steps_total", "pdspec_spec_accepted_tokens_total"):
            for do_sample in ("false", "true"):
                assert before[(name, (("do_sample", do_sample),))] == 0  # pre-initialised
        totals = {
            "verify": {"true": 0, "false": 0},
            "draft": {"true": 0, "false": 0},
            "accepted": {"true": 0, "false": 0},
        }
        per_position = {"true": [0] * 8, "false": [0] * 8}
        for seed in range(12):
            greedy = seed % 3 == 0
            out = client.generate(
                PROMPTS[seed % 4], seed=seed, greedy=greedy, max_new_tokens=30, num_speculative_tokens=1 + seed % 4
            )
            label = "false" if greedy else "true"
            totals["verify"][label] += out.stats.verify_steps
            totals["draft"][label] += out.stats.draft_tokens
            totals["accepted"][label] += out.stats.accepted_tokens
            for i, count in enumerate(out.stats.accepted_per_position):
                per_position[label][i] += count
        plain = client.generate("def ", max_new_tokens=20, num_speculative_tokens=0)  # K = 0: no spec series
        after = scrape(decode.metrics_port)
        # One request at a time: an engine step per verify step, and per decoded token at K = 0.
        steps = sum(totals["verify"].values()) + len(plain.token_ids) - 1
        assert after[("pdspec_engine_step_seconds_count", (("node", "decode"),))] == steps
        assert after[("pdspec_engine_step_seconds_sum", (("node", "decode"),))] > 0
        # The prefill node's steps: a request's first token, then its proposal and export (the
        # same step when it has no proposal to make).
        prefill_steps = scrape(prefill.metrics_port)[("pdspec_engine_step_seconds_count", (("node", "prefill"),))]
        assert 13 <= prefill_steps <= 2 * 13
        for label in ("true", "false"):
            key = (("do_sample", label),)
            assert after[("pdspec_spec_verify_steps_total", key)] == totals["verify"][label]
            assert after[("pdspec_spec_draft_tokens_total", key)] == totals["draft"][label]
            assert after[("pdspec_spec_accepted_tokens_total", key)] == totals["accepted"][label]
            assert after[("pdspec_spec_accept_length_count", key)] == totals["verify"][label]
            for i in range(8):
                series = (
                    "pdspec_spec_accepted_tokens_per_position_total",
                    (("do_sample", label), ("position", str(i))),
                )
                assert after[series] == per_position[label][i]
        assert after[("pdspec_requests_total", (("code", "OK"), ("node", "decode")))] == 13
        prefill_ok = scrape(prefill.metrics_port)[("pdspec_requests_total", (("code", "OK"), ("node", "prefill")))]
        assert prefill_ok == 13


def test_health_and_info(nodes):
    client, prefill, decode = nodes
    for port, service in ((prefill.port, "pdspec.v1.PrefillService"), (decode.port, "pdspec.v1.DecodeService")):
        assert health_status(port) == health_pb2.HealthCheckResponse.SERVING
        assert health_status(port, service) == health_pb2.HealthCheckResponse.SERVING
    info = client.info()
    assert info.role == "prefill" and info.target_vocab_size == 257 and len(info.draft_to_target) == 98


def test_a_compatible_decode_peer_that_answers_its_check_late_stays_compatible(pair, monkeypatch):
    """A busy decode node: the prefill node's periodic GetInfo outlasts its deadline while the
    connection is up (its keepalive pings answered). The prefill node stays SERVING and serves,
    where it used to answer every request UNAVAILABLE until a check came back in time. (A peer
    that is not connected is unreachable at once: the test below.)"""
    import prefill_node.server as prefill_server
    from decode_node.server import DecodeServicer

    monkeypatch.setattr(prefill_server, "INFO_TIMEOUT_S", 0.2)
    slow, checks, answer = threading.Event(), [], DecodeServicer.GetInfo

    def late(self, request, context):
        if slow.is_set():
            checks.append(time.monotonic())
            time.sleep(0.6)
        return answer(self, request, context)

    monkeypatch.setattr(DecodeServicer, "GetInfo", late)  # before the servicer is registered
    with cluster(pair, peer_check_s=0.05) as (client, prefill, _):  # checked every 0.5 s while compatible
        slow.set()
        wait_until(lambda: len(checks) >= 3, what="three late checks")
        assert prefill.peer.compatible and health_status(prefill.port) == health_pb2.HealthCheckResponse.SERVING
        assert len(client.generate(prompt_token_ids=list(range(3, 12)), greedy=True, max_new_tokens=4).token_ids) == 4


def test_prefill_waits_for_a_compatible_decode_peer(pair, tmp_path):
    from models.ngram import load_builtin_pair
    from prefill_node.server import PrefillNodeConfig
    from prefill_node.server import run_server as run_prefill

    config = PrefillNodeConfig(decode_addr="127.0.0.1:1", host="127.0.0.1", port=0, metrics_port=None, peer_check_s=0.1)
    with run_prefill(config, lambda: pair) as prefill:
        time.sleep(0.5)
        assert health_status(prefill.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            from pdspec.client import Client

            Client(f"127.0.0.1:{prefill.port}").generate("x")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" in err.value.details()
    (tmp_path / "c.txt").write_text("a different corpus: a different model and fingerprint\n" * 20)
    other = load_builtin_pair(tmp_path / "c.txt", tmp_path / "cache")
    from decode_node.server import DecodeNodeConfig
    from decode_node.server import run_server as run_decode

    with run_decode(DecodeNodeConfig(host="127.0.0.1", port=0, metrics_port=None), lambda: other) as decode:
        config = PrefillNodeConfig(
            decode_addr=f"127.0.0.1:{decode.port}", host="127.0.0.1", port=0, metrics_port=None, peer_check_s=0.1
        )
        with run_prefill(config, lambda: pair) as prefill:
            wait_until(lambda: "incompatible" in prefill.peer.problem, what="incompatibility noticed")
            assert health_status(prefill.port) == health_pb2.HealthCheckResponse.NOT_SERVING
