"""The prefill node's OpenAI-compatible HTTP API, through the official `openai` client and
raw httpx, against real nodes on loopback."""

import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from decode_node.engine import DecodeConfig
from prefill_node.http import ApiConfig, HttpCall, OpenAIApi
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill
from prefill_node.service import RequestFailed
from protos import pdspec_pb2
from tests.nodes.conftest import cluster, wait_until

KEY = "sk-test-key"
PROMPT = "def main():\n    "
CHAT = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "the dog sat on the mat"}]


def client_for(port: int, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def api(pair):
    with cluster(pair, http_port=0, api_key=KEY, client_options={"api_key": KEY}) as (grpc_client, prefill, decode):
        yield SimpleNamespace(
            oai=client_for(prefill.http_port),
            url=f"http://127.0.0.1:{prefill.http_port}",
            grpc=grpc_client,
            prefill=prefill,
            decode=decode,
            model=prefill.engine.contract.target_model,
        )


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def sse_events(lines) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in lines if line.startswith("data: ")]


# ---------------------------------------------------------------------------- models, completions


def test_models_list_the_served_target_and_its_draft(api):
    models = api.oai.models.list().data
    assert [m.id for m in models] == [api.model, api.prefill.engine.contract.draft_model]
    assert all(m.owned_by == "pdspec" and m.object == "model" and m.created > 0 for m in models)
    assert api.oai.models.retrieve(api.model).id == api.model


def test_greedy_completion_streamed_equals_whole_and_the_grpc_path(api):
    whole = api.oai.completions.create(model=api.model, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = whole.choices[0]
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.model == api.model
    assert choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(PROMPT.encode()) and whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == len(PROMPT.encode()) + 24
    same = api.grpc.generate(PROMPT, greedy=True, max_new_tokens=24)  # one generation path
    assert choice.text == same.text
    stats = whole.model_extra["pdspec"]
    assert stats["verify_steps"] > 0 and stats["draft_tokens"] >= stats["accepted_tokens"]
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted_tokens"] / stats["draft_tokens"])

    chunks = list(
        api.oai.completions.create(
            model=api.model,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == "length" and "pdspec" in final[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == len(PROMPT.encode())


def test_token_id_prompts_and_a_list_of_one(api):
    ids = list(PROMPT.encode())
    by_ids = api.oai.completions.create(model=api.model, prompt=ids, max_tokens=8, temperature=0)
    by_list = api.oai.completions.create(model=api.model, prompt=[PROMPT], max_tokens=8, temperature=0)
    by_text = api.oai.completions.create(model=api.model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_list.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_seeds_reproduce_and_speculation_per_request(api):
    def run(seed, k=None):
        extra = {} if k is None else {"num_speculative_tokens": k}
        out = api.oai.completions.create(
            model=api.model, prompt="import ", max_tokens=30, temperature=0.9, top_p=0.95, seed=seed, extra_body=extra
        )
        return out.choices[0].text, out.model_extra["pdspec"]

    first, second, other = run(42), run(42), run(43)
    assert first[0] == second[0] and first[0] != other[0]
    text, stats = run(42, k=0)
    assert stats["verify_steps"] == 0 and stats["draft_tokens"] == 0 and stats["acceptance_rate"] is None
    assert len(text.encode()) <= 30 * 4  # sampled with K=0: a valid completion of its own
    _, stats = run(42, k=2)
    assert stats["draft_tokens"] == 2 * stats["verify_steps"] > 0 and len(stats["accepted_per_position"]) == 2
    tree = api.oai.completions.create(
        model=api.model,
        prompt="import ",
        max_tokens=30,
        temperature=0,
        extra_body={"num_speculative_tokens": 2, "draft_candidates": 3},
    )
    plain = api.oai.completions.create(
        model=api.model, prompt="import ", max_tokens=30, temperature=0, extra_body={"num_speculative_tokens": 0}
    )
    stats = tree.model_extra["pdspec"]
    assert tree.choices[0].text == plain.choices[0].text  # greedy trees: the K = 0 text
    assert (
        stats["draft_tokens"] > 2 * stats["verify_steps"]
        and sum(stats["accepted_per_rank"]) == stats["accepted_tokens"]
    )


def test_stop_strings_and_stop_token_ids(api):
    full = api.oai.completions.create(model=api.model, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[10:13]
    cut = api.oai.completions.create(model=api.model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    token = full.encode()[5]
    by_id = api.oai.completions.create(
        model=api.model, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"stop_token_ids": [token]}
    )
    text = by_id.choices[0].text
    assert by_id.choices[0].finish_reason == "stop" and text.encode()[-1] == token and full.startswith(text)


def test_logprobs_are_the_targets_own(api, pair):
    out = api.oai.completions.create(model=api.model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and len(top) <= 3 and all(v <= 0 for v in top.values())
        assert max(top.values()) >= chosen - 1e-6  # greedy: the chosen token is the most likely
    logits, _ = pair.target.prefill(list(PROMPT.encode()))
    first_token = out.choices[0].text.encode()[0]  # byte-level: the first byte is the first token
    expected = torch.log_softmax(logits.float(), -1)[first_token]
    assert lp.token_logprobs[0] == pytest.approx(float(expected), abs=1e-5)
    streamed = api.oai.completions.create(
        model=api.model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3, stream=True
    )
    chunks = [c.choices[0].logprobs for c in streamed if c.choices]
    assert [t for c in chunks for t in c.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 99_999}, "max_tokens"),  # the engine's --max-new-tokens-limit
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"logprobs": 6}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"n": 2}, "n"),
        ({"echo": True}, "echo"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [300]}, "prompt"),  # out of the vocabulary
        ({"prompt": ""}, "prompt"),
        ({"extra_body": {"num_speculative_tokens": 99}}, "num_speculative_tokens"),
        ({"extra_body": {"draft_candidates": 99}}, "draft_candidates"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(api, kwargs, param):
    args = {"model": api.model, "prompt": "x", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        api.oai.completions.create(**args)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"]


def test_malformed_bodies_are_400_not_422(api):
    for body in (b"{not json", b'{"prompt": "x", "max_tokens": "many"}', b'{"max_tokens": 3}'):
        headers = {**auth(), "Content-Type": "application/json"}
        r = httpx.post(f"{api.url}/v1/completions", content=body, headers=headers)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    r = httpx.post(f"{api.url}/v1/completions", json={"prompt": "x", "max_tokens": "many"}, headers=auth())
    assert r.json()["error"]["param"] == "max_tokens"


def test_chat_without_a_template_is_400_saying_so(api):
    with pytest.raises(openai.BadRequestError) as err:
        api.oai.chat.completions.create(model=api.model, messages=CHAT)
    assert err.value.body["param"] == "messages" and "no chat template" in err.value.body["message"]


def test_unknown_model_is_404(api):
    for name in ("gpt-4o", api.prefill.engine.contract.draft_model):
        with pytest.raises(openai.NotFoundError) as err:
            api.oai.completions.create(model=name, prompt="x", max_tokens=2)
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        api.oai.models.retrieve("gpt-4o")


def test_api_key_is_required_on_v1_but_not_on_health(api):
    with pytest.raises(openai.AuthenticationError) as err:
        client_for(api.prefill.http_port, key="sk-wrong").completions.create(model=api.model, prompt="x")
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{api.url}/v1/models").status_code == 401
    assert httpx.get(f"{api.url}/health").status_code == 200


def test_busy_decode_node_is_429_and_a_down_peer_is_503(pair):
    with cluster(pair, DecodeConfig(max_batch=1, max_queue=0), http_port=0) as (_, prefill, decode):
        url = f"http://127.0.0.1:{prefill.http_port}/v1/completions"
        body = {"prompt": "import ", "max_tokens": 4000, "seed": 1, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30) as held:
            lines = held.iter_lines()
            assert next(lines).startswith("data: ")  # the request now holds the only decode slot
            wait_until(lambda: decode.engine.load == 1, what="slot taken")
            with pytest.raises(openai.RateLimitError) as err:
                client_for(prefill.http_port).completions.create(model=None, prompt="def ", max_tokens=50)
            assert err.value.status_code == 429 and err.value.body["type"] == "rate_limit_error"
        wait_until(lambda: decode.engine.load == 0, timeout=2, what="slot freed by the disconnect")
    config = PrefillNodeConfig(
        decode_addr="127.0.0.1:1",
        host="127.0.0.1",
        port=0,
        metrics_port=None,
        peer_check_s=0.1,
        http_port=0,
        http_ready_wait_s=0.2,  # held that long for the peer, then 503 (test_http_readiness.py)
    )
    with run_prefill(config, lambda: pair) as prefill:
        assert httpx.get(f"http://127.0.0.1:{prefill.http_port}/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as err:
            client_for(prefill.http_port).completions.create(model=None, prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and "unreachable" in err.value.body["message"]
        assert err.value.response.headers["retry-after"] == "1"


# ---------------------------------------------------------------------------- disconnects


def test_disconnect_mid_stream_cancels_the_request(api):
    cancelled = api.prefill.metrics.requests.labels("prefill", "CANCELLED")
    before = cancelled._value.get()
    body = {"model": api.model, "prompt": "import ", "max_tokens": 4096, "seed": 5, "stream": True}
    with httpx.stream("POST", f"{api.url}/v1/completions", json=body, headers=auth(), timeout=30) as response:
        lines = (line for line in response.iter_lines() if line)
        next(lines), next(lines)
        wait_until(lambda: api.decode.engine.load == 1, what="request in the batch")
    started = time.monotonic()
    wait_until(lambda: api.decode.engine.load == 0, timeout=2, what="slot freed after the disconnect")
    assert time.monotonic() - started < 2
    wait_until(lambda: cancelled._value.get() == before + 1, timeout=2, what="counted CANCELLED")


def test_disconnect_while_waiting_for_a_whole_completion_cancels_it(api):
    body = {"model": api.model, "prompt": "import ", "max_tokens": 4096, "seed": 7}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.url}/v1/completions", json=body, headers=auth(), timeout=httpx.Timeout(30, read=0.7))
    wait_until(lambda: api.decode.engine.load == 0, timeout=2, what="slot freed after the client left")


# ---------------------------------------------------------------------------- chat


@pytest.fixture(scope="module")
def chat_api(tmp_path_factory):
    from transformers import AutoTokenizer

    from models.loader import load_pair
    from tests.models.hf_fixtures import WORDS, make_llama

    directory = make_llama(tmp_path_factory.mktemp("chat") / "target", len(set(WORDS)) + 2, seed=1, words=WORDS)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}the {% endif %}"
    )
    tokenizer.save_pretrained(directory)
    chat_pair = load_pair(target_model=directory, draft_layers=1)
    with cluster(chat_pair, http_port=0, served_model_name="tiny-chat") as (_, prefill, decode):
        yield SimpleNamespace(oai=client_for(prefill.http_port), pair=chat_pair, prefill=prefill, decode=decode)


def test_chat_completions_through_the_template(chat_api):
    oai, tokenizer = chat_api.oai, chat_api.pair.tokenizer
    assert oai.models.list().data[0].id == "tiny-chat"
    whole = oai.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    assert whole.usage.prompt_tokens == len(prompt_ids) and 1 <= whole.usage.completion_tokens <= 12
    assert "pdspec" in whole.model_extra
    stream = oai.chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_logprobs_and_parts(chat_api):
    out = chat_api.oai.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": [{"type": "text", "text": "the cat"}]}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"stop_token_ids": []},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6 and isinstance(entry.bytes, list)
    with pytest.raises(openai.BadRequestError) as err:
        chat_api.oai.chat.completions.create(model="tiny-chat", messages=CHAT, top_logprobs=9, logprobs=True)
    assert err.value.body["param"] == "top_logprobs"
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    unsupported = [({"tools": [tool]}, "tools"), ({"response_format": {"type": "xml"}}, "response_format")]
    for extra, param in unsupported:
        with pytest.raises(openai.BadRequestError) as err:
            chat_api.oai.chat.completions.create(model="tiny-chat", messages=CHAT, extra_body=extra)
        assert err.value.body["param"] == param


# ---------------------------------------------------------------------------- unit: the translation


class _FakeService:
    """A GenerationService stand-in that fails after its first response."""

    def __init__(self, pair, code: str) -> None:
        self.engine = SimpleNamespace(contract=pair.contract(), pair=pair)
        self.peer = SimpleNamespace(compatible=True, problem="")
        self.code = code

    def generate(self, request, call):
        yield pdspec_pb2.GenerateResponse(request_id=request.request_id, token_ids=[65], text="A")
        raise RequestFailed(self.code, f"request {request.request_id!r}: {self.code}", request.request_id)


def test_an_error_after_the_first_chunk_is_an_sse_event(pair):
    from fastapi.testclient import TestClient

    api = OpenAIApi(_FakeService(pair, "UNAVAILABLE"), ApiConfig())
    try:
        with TestClient(api.app) as http:
            response = http.post("/v1/completions", json={"prompt": "x", "stream": True})
            events = sse_events(response.text.splitlines())
            assert events[0]["choices"][0]["text"] == "A"
            assert events[-1]["error"]["type"] == "service_unavailable" and "[DONE]" not in events
            whole = http.post("/v1/completions", json={"prompt": "x"})
            assert whole.status_code == 503
            api.service.code = "INTERNAL"
            assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 500
    finally:
        api.close()


def test_http_call_cancel_runs_callbacks_once():
    call, seen = HttpCall(), []
    assert call.add_callback(lambda: seen.append(1)) and call.is_active() and call.time_remaining() is None
    call.cancel()
    call.cancel()
    assert seen == [1] and not call.is_active() and not call.add_callback(lambda: seen.append(2))
