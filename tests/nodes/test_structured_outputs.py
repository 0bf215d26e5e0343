"""Structured outputs through both nodes (built-in byte-level pair, real gRPC and HTTP on loopback):
outputs that parse and validate, speculation that changes nothing, the masked law, bad inputs."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from decode_node.engine import DecodeConfig
from engine.spec_config import SpeculativeConfig
from prefill_node.engine import PrefillConfig
from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.contract import PROTOCOL_VERSION
from protos.status import field_violations
from sampling.proposal import DraftLaw
from tests.nodes.conftest import cluster
from tests.sampling.helpers import ALPHA, chi_square_pvalue

SCHEMAS = [
    {  # object, enum, bounded integer
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "colour": {"enum": ["red", "green", "blue"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "colour", "age"],
        "additionalProperties": False,
    },
    {  # an array with bounds, of nested objects
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    {  # nesting, a pattern, a bounded array of strings
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
                },
                "required": ["zip", "tags"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
]
PROMPT = "def main():\n    config = "


def schema_output(schema: dict) -> pdspec_pb2.StructuredOutput:
    return pdspec_pb2.StructuredOutput(json_schema=json.dumps(schema))


@pytest.fixture(scope="module")
def nodes(pair):
    with cluster(pair, http_port=0) as running:
        yield running


def oai(prefill) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{prefill.http_port}/v1", api_key="-", max_retries=0, timeout=30)


def samples(prefill, node: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://127.0.0.1:{prefill if isinstance(prefill, int) else prefill.metrics_port}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "nested"])
def test_outputs_parse_and_validate_and_speculation_changes_nothing(nodes, schema):
    client, _, _ = nodes
    runs = {}
    for k in (0, 4):
        for seed in (None, 1, 2):  # greedy, then seeded sampling (point-mass drafts: verified by coupling)
            out = client.generate(
                PROMPT,
                max_new_tokens=400,
                greedy=seed is None,
                seed=seed,
                num_speculative_tokens=k,
                structured_output=schema_output(schema),
            )
            assert out.finish_reason == "stop", out.text  # the grammar completed
            jsonschema.validate(json.loads(out.text), schema)
            runs[k, seed] = list(out.token_ids)
            if k:
                assert out.stats.jump_forward_tokens > 0  # keys and punctuation are forced
    for seed in (None, 1, 2):
        assert runs[0, seed] == runs[4, seed]


def test_regex_choice_grammar_and_json_object_over_http(nodes):
    _, prefill, _ = nodes
    api = oai(prefill)
    model = api.models.list().data[0].id

    def complete(extra: dict, **kw) -> openai.types.Completion:
        return api.completions.create(model=model, prompt=PROMPT, max_tokens=200, extra_body=extra, **kw)

    out = complete({"structured_outputs": {"regex": "[a-z]{2,8}@[a-z]{2,6}\\.(com|org)"}}, temperature=0)
    assert out.choices[0].finish_reason == "stop"
    assert re.fullmatch("[a-z]{2,8}@[a-z]{2,6}\\.(com|org)", out.choices[0].text)
    choices = ["alpha", "beta", "gamma"]
    for seed in range(3):
        out = complete({"structured_outputs": {"choice": choices}}, seed=seed)
        assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    out = complete({"structured_outputs": {"grammar": grammar}}, temperature=0)
    text = out.choices[0].text
    assert text.startswith("(") and text.endswith(")") and all(p.isdigit() for p in text[1:-1].split(","))
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}):
        stream = api.completions.create(
            model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"response_format": fmt}
        )
        chunks = list(stream)
        value = json.loads("".join(c.choices[0].text for c in chunks))
        assert isinstance(value, dict) and chunks[-1].choices[0].finish_reason == "stop"
        if fmt["type"] == "json_schema":
            jsonschema.validate(value, SCHEMAS[0])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "no"}}}}, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"if": {}}}}}, None),
        ({"response_format": {"type": "yaml"}}, None),
        ({"structured_outputs": {"regex": "(unclosed"}}, None),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None),
        ({"structured_outputs": {"choice": []}}, None),
        ({"structured_outputs": {"xml": "<a/>"}}, None),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(nodes, extra, param):
    _, prefill, _ = nodes
    api = oai(prefill)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=api.models.list().data[0].id, prompt=PROMPT, max_tokens=8, extra_body=extra)
    assert err.value.body["param"] == (param or next(iter(extra)))
    assert err.value.body["message"].startswith(err.value.body["param"])


def test_bad_constraints_are_invalid_argument_on_grpc_and_counted(nodes):
    client, prefill, _ = nodes
    bad = {
        "structured_output.regex": pdspec_pb2.StructuredOutput(regex="[z-a]"),
        "structured_output.json_schema": pdspec_pb2.StructuredOutput(
            json_schema='{"type": "string", "minLength": 5, "maxLength": 2}'  # unsatisfiable
        ),
        "structured_output.json_object": pdspec_pb2.StructuredOutput(json_object=False),
        "structured_output.choice": pdspec_pb2.StructuredOutput(choice=pdspec_pb2.ChoiceList(values=["a", "a"])),
    }
    before = samples(prefill, "prefill")
    for field, message in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, max_new_tokens=8, structured_output=message)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err.value)] == [field]
    after = samples(prefill, "prefill")
    for field in bad:
        key = ("pdspec_validation_rejections_total", (("field", field), ("node", "prefill")))
        assert after[key] - before.get(key, 0.0) == 1
    out = client.generate(PROMPT, max_new_tokens=8, greedy=True)  # the node serves on
    assert out.finish_reason == "length"


def test_the_decode_node_checks_the_constraint_and_the_first_token(nodes, pair):
    """A direct caller of the decode node: the constraint compiles there too, and the first token
    must be one the constraint allows (the prefill node drew it under the same mask)."""
    _, _, decode = nodes

    def request(first: int, output: pdspec_pb2.StructuredOutput) -> pdspec_pb2.DecodeRequest:
        out = pdspec_pb2.DecodeRequest(
            request_id="direct",
            protocol_version=PROTOCOL_VERSION,
            contract_fingerprint=pair.contract().fingerprint(),
            prompt_token_ids=list(b"x = "),
            first_token_id=first,
            sampling=pdspec_pb2.SamplingParams(max_new_tokens=8),
        )
        out.proposal.encoding = pdspec_pb2.Proposal.POINT_MASS  # K = 0: no drafts
        out.structured_output.CopyFrom(output)
        return out

    regex = pdspec_pb2.StructuredOutput(regex="a[0-9]{3}")
    with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = pdspec_pb2_grpc.DecodeServiceStub(channel)
        messages = list(stub.Decode(request(ord("a"), regex), timeout=10))
        assert re.fullmatch("[0-9]{3}", bytes(t for m in messages for t in m.token_ids).decode())
        assert messages[-1].finish_reason == "stop"
        bad = [
            (request(ord("b"), regex), "first_token_id"),
            (request(ord("a"), pdspec_pb2.StructuredOutput(regex="(")), "structured_output.regex"),
        ]
        for message, field in bad:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Decode(message, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [f for f, _ in field_violations(err.value)] == [field]


def test_metrics_count_kinds_masks_and_jump_forward(nodes):
    client, prefill, decode = nodes
    client.generate(PROMPT, max_new_tokens=200, greedy=True, structured_output=schema_output(SCHEMAS[0]))
    front, back = samples(prefill, "prefill"), samples(decode.metrics_port, "decode")
    kind = (("kind", "json_schema"), ("node", "prefill"))
    assert front["pdspec_structured_output_requests_total", kind] >= 1
    assert back["pdspec_grammar_mask_seconds_count", (("node", "decode"),)] > 0
    assert back["pdspec_grammar_jump_forward_tokens_total", (("node", "decode"),)] > 0


# ---------------------------------------------------------------------------- the law, through both nodes

# No position forced: every token after the first is a draft's or the target's draw, so the drafts'
# test decides what is emitted (with jump-forward, a forced prefix leaves nothing to test).
LAW_REGEX = "[ab]{3}"
CHOICES = [a + b + c for a in "ab" for b in "ab" for c in "ab"]  # its language
LAW_PROMPT = "answer = '"
LAW_REQUESTS = 400


def language_law(pair, prompt: list[int]) -> dict[str, float]:
    """The masked law over a finite language (CHOICES), from the target's own logits (the
    oracle): at each position a softmax over the allowed bytes only; EOS allowed where a string
    is complete and longer ones go on."""
    eos = pair.target.eos_token_ids[0]
    law = {}
    for choice in CHOICES:
        logits_at, state = pair.target.prefill(prompt)
        rows = [logits_at, *pair.target.extend(state, list(choice.encode()))]  # after each prefix
        p = 1.0
        for i in range(len(choice) + 1):
            prefix = choice[:i]
            allowed = sorted({ord(c[i]) for c in CHOICES if c.startswith(prefix) and len(c) > i})
            if prefix in CHOICES:
                if not allowed:
                    break  # complete, nothing can follow: the request ends here
                allowed.append(eos)
            mine = eos if i == len(choice) else ord(choice[i])
            p *= float(torch.softmax(rows[i][allowed].double(), -1)[allowed.index(mine)])
        law[choice] = p
    assert abs(sum(law.values()) - 1) < 1e-9
    return law


@pytest.fixture(scope="module")
def stochastic_nodes(pair):
    """Stochastic drafts: they draw forbidden tokens, which the masked law must reject."""
    spec = SpeculativeConfig(draft_law=DraftLaw.STOCHASTIC, max_draft_candidates=4)
    decode = DecodeConfig(
        spec=dataclasses.replace(DecodeConfig().spec, draft_law=spec.draft_law, max_draft_candidates=4)
    )
    prefill = PrefillConfig(
        spec=dataclasses.replace(PrefillConfig().spec, draft_law=spec.draft_law, max_draft_candidates=4)
    )
    with cluster(pair, decode, prefill) as running:
        yield running


def test_sampled_constrained_requests_follow_the_masked_law(pair, stochastic_nodes):
    client, _, _ = stochastic_nodes
    constraint = pdspec_pb2.StructuredOutput(regex=LAW_REGEX)

    def one(seed: int):
        out = client.generate(LAW_PROMPT, max_new_tokens=10, seed=seed, structured_output=constraint)
        assert out.finish_reason == "stop"
        return out

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(LAW_REQUESTS)))
    texts = [out.text for out in outs]
    # The drafts were drawn under the grammar: none forbidden, and many drafted.
    assert sum(out.stats.grammar_rejected_drafts for out in outs) == 0
    assert sum(out.stats.draft_tokens for out in outs) > LAW_REQUESTS
    law = language_law(pair, pair.tokenizer.encode(LAW_PROMPT))
    counts = Counter(texts)
    assert set(counts) <= set(CHOICES)
    observed = torch.tensor([CHOICES.index(t) for t in texts])
    assert chi_square_pvalue(observed, torch.tensor([law[c] for c in CHOICES])) > ALPHA, (counts, law)


def test_candidate_trees_under_a_grammar(stochastic_nodes):
    """Trees: one mask per node, drafts drawn under the grammar per branch; greedy rows equal K = 0."""
    client, _, _ = stochastic_nodes
    schema = SCHEMAS[1]
    runs = []
    for k, candidates in ((0, 1), (4, 2), (4, 4)):
        out = client.generate(
            PROMPT,
            max_new_tokens=300,
            greedy=True,
            num_speculative_tokens=k,
            draft_candidates=candidates,
            structured_output=schema_output(schema),
        )
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
        runs.append(list(out.token_ids))
    assert runs[0] == runs[1] == runs[2]
    for seed in range(3):
        out = client.generate(
            PROMPT, max_new_tokens=300, seed=seed, draft_candidates=3, structured_output=schema_output(schema)
        )
        assert out.finish_reason == "stop" and out.stats.draft_tokens > 0
        jsonschema.validate(json.loads(out.text), schema)
