"""The OpenAI HTTP API's readiness: it listens before any health check says SERVING, holds
/v1/* requests while the decode peer is not compatible (then serves them), and answers 503
with Retry-After in OpenAI's shape when the wait runs out. Real nodes on loopback."""

import dataclasses
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from decode_node.server import DecodeNodeConfig
from decode_node.server import run_server as run_decode
from pdspec.serving import NodeShell
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill
from tests.nodes.conftest import cluster, wait_until

ERROR_KEYS = {"message", "type", "param", "code"}
PREFILL_SERVICE = "pdspec.v1.PrefillService"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefill_config(decode_port: int, **overrides) -> PrefillNodeConfig:
    base = PrefillNodeConfig(
        decode_addr=f"127.0.0.1:{decode_port}",
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        peer_check_s=0.1,
        http_port=0,
    )
    return dataclasses.replace(base, **overrides)


def oai(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)


def http_count(prefill, route: str, code: str) -> float:
    labels = {"route": route, "code": code}
    return prefill.metrics.registry.get_sample_value("pdspec_http_requests_total", labels) or 0.0


def test_the_http_port_listens_before_health_says_serving(pair, monkeypatch):
    http_port, seen = free_port(), []
    original = NodeShell.set_serving

    def set_serving(self, serving: bool) -> None:
        if serving and self.service == PREFILL_SERVICE:  # the prefill's health turns SERVING: is its HTTP API there?
            try:
                socket.create_connection(("127.0.0.1", http_port), timeout=2).close()
                seen.append(True)
            except OSError:
                seen.append(False)
        original(self, serving)

    monkeypatch.setattr(NodeShell, "set_serving", set_serving)
    with cluster(pair, http_port=http_port) as (_, prefill, _decode):
        assert prefill.http_port == http_port
        assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).status_code == 200
    assert seen and all(seen), seen


def test_requests_wait_for_the_decode_peer_then_are_served(pair):
    decode_port = free_port()  # nothing listens there yet
    with run_prefill(prefill_config(decode_port), lambda: pair) as prefill:
        base = f"http://127.0.0.1:{prefill.http_port}"
        api = prefill.http.api
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        with ThreadPoolExecutor(2) as pool:
            models = pool.submit(lambda: oai(prefill.http_port).models.list().data)
            completion = pool.submit(
                lambda: oai(prefill.http_port).completions.create(
                    model=None, prompt="def ", max_tokens=6, temperature=0
                )
            )
            wait_until(lambda: api.waiting == 2, what="both requests held for the decode peer")
            assert not models.done() and not completion.done()
            with run_decode(DecodeNodeConfig(host="127.0.0.1", port=decode_port, metrics_port=None), lambda: pair):
                listed = [m.id for m in models.result(timeout=30)]
                assert listed == [prefill.engine.contract.target_model, prefill.engine.contract.draft_model]
                out = completion.result(timeout=30)
                assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
                assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        assert api.waiting == 0
        assert http_count(prefill, "/v1/models", "200") == 1 and http_count(prefill, "/v1/completions", "200") == 1


def test_not_ready_is_503_with_retry_after_on_every_endpoint(pair):
    with run_prefill(prefill_config(1, http_ready_wait_s=0.2), lambda: pair) as prefill:
        base = f"http://127.0.0.1:{prefill.http_port}"
        requests = [
            ("GET", "/v1/models", None),
            ("GET", f"/v1/models/{prefill.engine.contract.target_model}", None),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ]
        for method, path, body in requests:
            r = httpx.request(method, base + path, json=body, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == ERROR_KEYS and error["type"] == "service_unavailable", error
            assert error["code"] == "unavailable" and "unreachable" in error["message"]
        # the official client lists no models and generates nothing while the node cannot serve
        with pytest.raises(openai.InternalServerError) as err:
            oai(prefill.http_port).models.list()
        assert err.value.status_code == 503
        # bad input is refused at once, whatever the peer
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # no key configured: the OpenAPI document is open
        assert httpx.get(f"{base}/openapi.json", timeout=10).status_code == 200


def test_a_held_request_honours_the_clients_timeout_and_its_disconnect(pair):
    with run_prefill(prefill_config(1, http_ready_wait_s=60), lambda: pair) as prefill:
        base, api = f"http://127.0.0.1:{prefill.http_port}", prefill.http.api
        # openai-python says how long it waits: the 503 comes before that (here at once)
        r = httpx.get(f"{base}/v1/models", headers={"x-stainless-read-timeout": "1"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        # a client that leaves while held frees its place and is counted 499
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=httpx.Timeout(30, read=0.5))
        wait_until(lambda: api.waiting == 0, timeout=10, what="the held request let go")
        wait_until(lambda: http_count(prefill, "/v1/completions", "499") == 1, timeout=10, what="counted 499")
