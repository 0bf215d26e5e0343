"""Bad input to the OpenAI HTTP API is a 4xx in OpenAI's error shape, never a 500, and every
HTTP request is counted once in pdspec_http_requests_total{route,code}; the OpenAPI document
needs the API key; the /metrics server answers /metrics only. Real nodes on loopback (the
built-in n-gram pair), official `openai` client, httpx and a hypothesis fuzzer."""

import json
from collections import Counter
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.nodes.conftest import cluster, wait_until

KEY = "sk-inputs"
ERROR_KEYS = {"message", "type", "param", "code"}
MAX_ERROR_CHARS = 600  # an error message never quotes unbounded client input


@pytest.fixture(scope="module")
def node(pair):
    with cluster(pair, http_port=0, api_key=KEY, client_options={"api_key": KEY}) as (_, prefill, decode):
        base = f"http://127.0.0.1:{prefill.http_port}"
        with httpx.Client(base_url=base, headers=auth(), timeout=60) as http:
            yield SimpleNamespace(
                http=http,
                prefill=prefill,
                decode=decode,
                model=prefill.engine.contract.target_model,
                oai=openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60),
            )


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def post_raw(node, path: str, content: bytes) -> httpx.Response:
    return node.http.post(path, content=content, headers={"Content-Type": "application/json"})


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and isinstance(error["message"], str), error
    assert len(error["message"]) <= MAX_ERROR_CHARS and (error["param"] is None or len(error["param"]) <= 100)
    if status is not None:
        assert response.status_code == status, (response.status_code, error)
    return error


def scrape(node) -> Counter:
    """pdspec_http_requests_total by (route, code), read from the node's /metrics page."""
    text = httpx.get(f"http://127.0.0.1:{node.prefill.metrics_port}/metrics", timeout=10).text
    out: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdspec_http_requests_total":
                out[sample.labels["route"], sample.labels["code"]] = sample.value
    return out


def still_serves(node) -> None:
    out = node.oai.completions.create(model=node.model, prompt="def ", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    wait_until(lambda: node.decode.engine.load == 0 and node.prefill.service.in_flight == 0, what="idle")


# ---------------------------------------------------------------------------- bad input, by hand


SURROGATE = "abc\ud800"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": SURROGATE, "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": [SURROGATE]}, "prompt[0]"),
        ("/v1/completions", {"prompt": "x", "stop": SURROGATE}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", SURROGATE], "stream": True}, "stop[1]"),
        ("/v1/completions", {"prompt": "x", "user": SURROGATE}, "user"),
        ("/v1/completions", {"prompt": "x", "unknown": {"deep": [SURROGATE]}}, "unknown.deep[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}], "stream": True},
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": SURROGATE}, "stop"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(node, path, body, param):
    raw = json.dumps({"model": node.model, "max_tokens": 4, **body}).encode()  # ASCII: "\ud800" escaped
    assert b"\\ud800" in raw
    error = assert_openai_error(post_raw(node, path, raw), 400)
    assert error["param"] == param and "surrogate" in error["message"], error


def test_malformed_json_names_no_parameter(node):
    for raw in (b'{"prompt": "x", "max_tokens": 3,,}', b"{not json", b"\xff\xfe", b"[" * 100_000):
        error = assert_openai_error(post_raw(node, "/v1/completions", raw), 400)
        assert error["param"] is None and error["code"] == "invalid_json", (raw[:20], error)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [2**32]}, "prompt"),  # not an int32 token id: was a 500 building the request
        ({"prompt": "x", "temperature": 1e400}, "temperature"),  # json: Infinity
        ({"prompt": "x", "top_p": float("nan")}, "top_p"),
        ({"prompt": "x", "n": 10**3000}, "n"),
        ({"prompt": "x", "stop_token_ids": ["a"] * 1000}, "stop_token_ids[0]"),
        ({"prompt": "x", "best_of": -(10**300)}, "best_of"),
    ],
)
def test_out_of_range_values_are_400_with_bounded_messages(node, body, param):
    error = assert_openai_error(post_raw(node, "/v1/completions", json.dumps(body).encode()), 400)
    assert error["param"] == param, error


def test_echoed_values_are_clipped(node):
    name = "m" * 100_000
    r = node.http.post("/v1/completions", json={"model": name, "prompt": "x"})
    error = assert_openai_error(r, 404)
    assert "100000 characters" in error["message"] and len(error["message"]) < 200
    error = assert_openai_error(node.http.get("/v1/models/" + "x" * 10_000), 404)
    assert len(error["message"]) < 200


# ---------------------------------------------------------------------------- counting, auth, /metrics


def test_every_http_request_is_counted_once_by_route_and_code(node):
    before = scrape(node)
    expected = Counter()

    def send(method: str, path: str, route: str, code: int, **kwargs) -> None:
        r = node.http.request(method, path, **kwargs)
        assert r.status_code == code, (method, path, r.status_code, r.text[:200])
        expected[route, str(code)] += 1

    ok = {"model": node.model, "prompt": "def ", "max_tokens": 3, "temperature": 0}
    raw_json = {"Content-Type": "application/json"}
    send("POST", "/v1/completions", "/v1/completions", 200, json=ok)
    send("POST", "/v1/completions", "/v1/completions", 200, json={**ok, "stream": True})
    send("POST", "/v1/completions", "/v1/completions", 400, content=b"{bad", headers=raw_json)
    send("POST", "/v1/completions", "/v1/completions", 400, content=json.dumps({"prompt": SURROGATE}), headers=raw_json)
    send("POST", "/v1/completions", "/v1/completions", 400, json={"prompt": "x", "max_tokens": "many"})
    send("POST", "/v1/completions", "/v1/completions", 404, json={**ok, "model": "gpt-4o"})
    send("POST", "/v1/completions", "/v1/completions", 401, json=ok, headers={"Authorization": "Bearer wrong"})
    send("GET", "/v1/completions", "/v1/completions", 405)
    send("POST", "/v1/chat/completions", "/v1/chat/completions", 400, json={"messages": []})
    send("GET", "/v1/models", "/v1/models", 200)
    send("GET", f"/v1/models/{node.model}", "/v1/models/{model_id}", 200)
    send("GET", "/v1/models/nope", "/v1/models/{model_id}", 404)
    send("GET", "/health", "/health", 200, headers={"Authorization": ""})
    send("GET", "/no/such/path", "other", 404)
    send("GET", "/no/such/path", "other", 401, headers={"Authorization": ""})
    send("GET", "/openapi.json", "/openapi.json", 200)
    send("GET", "/openapi.json", "/openapi.json", 401, headers={"Authorization": ""})
    after = scrape(node)
    delta = Counter({key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)})
    assert delta == expected


def test_openapi_needs_the_key_and_metrics_answers_only_metrics(node):
    r = httpx.get(f"http://127.0.0.1:{node.prefill.http_port}/openapi.json", timeout=10)
    assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
    assert node.http.get("/openapi.json").json()["paths"]["/v1/completions"]
    for path in ("/docs", "/redoc"):  # not served
        assert_openai_error(node.http.get(path), 404)
    metrics = f"http://127.0.0.1:{node.prefill.metrics_port}"
    assert httpx.get(f"{metrics}/metrics", timeout=10).status_code == 200
    for path in ("/", "/metrics/x", "/index.html"):
        assert httpx.get(metrics + path, timeout=10).status_code == 404


# ---------------------------------------------------------------------------- fuzz

ROUTES = ("/v1/completions", "/v1/chat/completions")

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "best_of",
    "suffix", "user", "presence_penalty", "frequency_penalty", "logit_bias", "num_speculative_tokens",
    "draft_candidates", "tools", "response_format", "structured_outputs",
]  # fmt: skip
TEXT = st.text(
    st.characters(codec=None, exclude_categories=()) | st.sampled_from(["\ud800", "\udfff", "\x00", "é", "𝄞"]),
    max_size=12,
)
NUMBERS = (
    st.integers(-3, 40)
    | st.sampled_from([2**31 - 1, 2**31, 2**63, 2**64, -(2**63), 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
)
LEAVES = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(
    LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | TEXT},
    optional={"content": TEXT | JSON | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}))},
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "prompt": TEXT | st.lists(st.integers(-1, 300), max_size=4) | JSON,
        "messages": st.lists(MESSAGE, max_size=3) | JSON,
        "max_tokens": st.integers(-1, 6) | JSON,  # small: generating is not what is fuzzed
        "stream": st.booleans() | JSON,
        "stop": TEXT | st.lists(TEXT, max_size=3) | JSON,
        "temperature": NUMBERS | JSON,
    },
)
EXTRA = st.dictionaries(st.sampled_from(FIELDS) | TEXT, JSON, max_size=3)  # any field, any value
BODY = BODY.flatmap(lambda body: EXTRA.map(lambda extra: {**extra, **body}))


def encode(body, mode: int) -> bytes:
    """The body as JSON (ASCII, so lone surrogates travel as escapes), or cut short, or doubled."""
    raw = json.dumps(body).encode()
    return (raw, raw[: len(raw) // 2], raw + raw)[mode]


def test_fuzzed_bodies_never_get_a_500_and_the_node_serves_after(node):
    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(
        path=st.sampled_from(ROUTES),
        body=st.one_of(BODY, JSON),
        mode=st.sampled_from([0, 0, 0, 0, 1, 2]),
    )
    @example(path="/v1/completions", body={"prompt": "abc\ud800", "stream": True}, mode=0)
    @example(path="/v1/chat/completions", body={"messages": [{"role": "\udc00", "content": "x"}]}, mode=0)
    def post(path, body, mode):
        r = post_raw(node, path, encode(body, mode))
        assert r.status_code < 500, (r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert_openai_error(r)
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")

    before = scrape(node)
    post()
    still_serves(node)
    after = scrape(node)
    assert all(after[route, "500"] == before.get((route, "500"), 0) for route in ROUTES)
    assert sum(after.values()) - sum(before.values()) >= 150 + 1  # every body was answered and counted


# ---------------------------------------------------------------------------- the last resort


class _BrokenService:
    """A GenerationService stand-in whose generation fails with a bug (not a RequestFailed)."""

    def __init__(self, pair) -> None:
        from pdspec.metrics import NodeMetrics

        self.engine = SimpleNamespace(contract=pair.contract(), pair=pair)
        self.peer = SimpleNamespace(compatible=True, problem="")
        self.metrics = NodeMetrics("prefill", 4)

    def generate(self, request, call):
        raise RuntimeError("a bug")
        yield


def test_an_unexpected_error_is_a_logged_counted_500_in_openai_shape(pair, caplog):
    from fastapi.testclient import TestClient

    from prefill_node.http import ApiConfig, OpenAIApi

    service = _BrokenService(pair)
    api = OpenAIApi(service, ApiConfig())
    try:
        with TestClient(api.asgi) as http:
            for stream in (False, True):
                r = http.post("/v1/completions", json={"prompt": "x", "stream": stream})
                error = assert_openai_error(r, 500)
                assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    finally:
        api.close()
    labels = {"route": "/v1/completions", "code": "500"}
    assert service.metrics.registry.get_sample_value("pdspec_http_requests_total", labels) == 2
    assert "a bug" in caplog.text
