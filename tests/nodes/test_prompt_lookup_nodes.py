"""Prompt lookup and hybrid drafting through real nodes (gRPC on loopback, the built-in pair):
greedy output equals the K = 0 output token for token; RequestStats, GetInfo and /metrics
report the method, the chosen K per step and the tokens prompt lookup proposed; a seeded
request draws the same tokens alone or beside others (K depends on its own history only)."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode_node.engine import DecodeConfig
from engine.adaptive import StepCosts
from engine.spec_config import SpeculativeConfig
from pdspec.client import decode_info
from prefill_node.engine import PrefillConfig
from tests.nodes.conftest import cluster

K = 4
# Fixed step costs: a seeded run never depends on the start-up timings (calibrate is a no-op).
COSTS = StepCosts((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8))
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
PROMPTS = [
    CODE * 2,
    "class Foo:\n    def __init__(self):\n        self.x = 1\n\nclass Foo:\n    def __init__(self):\n        self.",
    "self.assertEqual(a, b)\nself.assertEqual(a, b)\nself.assert",
    "return self._name\n\n    def name(self):\n        return self._",
    "import os\nimport sys\nimport ",
    "import a\nimport b\nimport c\nimport",  # then " ": three continuations, a tree with candidates
]
REPETITIVE = PROMPTS[3]
# (method, --prompt-lookup-min, --prompt-lookup-max): hybrid on a non-default range
SETUPS = [("prompt-lookup", 2, 5), ("hybrid", 3, 6)]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module", params=SETUPS, ids=[setup[0] for setup in SETUPS])
def lookup_nodes(request, pair):
    method, lo, hi = request.param
    decode_config = DecodeConfig(
        spec=SpeculativeConfig(method=method, prompt_lookup_min=lo, prompt_lookup_max=hi), step_costs=COSTS
    )
    prefill_config = PrefillConfig(spec=SpeculativeConfig(method=method, prompt_lookup_min=lo, prompt_lookup_max=hi))
    with cluster(pair, decode_config, prefill_config) as (client, prefill, decode):
        yield request.param, client, prefill, decode


def drafted(chosen_k) -> int:
    """Draft tokens the decode node chose over its steps (index = K)."""
    return sum(k * count for k, count in enumerate(chosen_k))


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(("k", "candidates"), [(K, 1), (K, 2), (8, 1)])  # 8: the node's largest K
def test_greedy_output_equals_k0(lookup_nodes, prompt, k, candidates):
    (method, _, _), client, _, _ = lookup_nodes
    plain = client.generate(prompt, greedy=True, max_new_tokens=48, num_speculative_tokens=0)
    spec = client.generate(
        prompt, greedy=True, max_new_tokens=48, num_speculative_tokens=k, draft_candidates=candidates
    )
    assert len(plain.token_ids) == 48 and spec.finish_reason == plain.finish_reason == "length"
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text
    stats = spec.stats
    assert stats.speculative_method == method
    assert len(stats.chosen_k) == k + 1
    assert sum(stats.chosen_k) > 0  # the decode node's own steps, whatever K they chose
    # Every step with K > 0 verified something; the one verify step more, if any, is the prefill's proposal.
    assert stats.verify_steps - sum(stats.chosen_k[1:]) in (0, 1)
    assert stats.prompt_lookup_tokens <= stats.draft_tokens
    assert stats.accepted_tokens <= stats.draft_tokens
    assert len(stats.accepted_per_position) == k
    assert plain.stats.speculative_method == method and list(plain.stats.chosen_k) == [0]  # K = 0: no choice
    assert plain.stats.prompt_lookup_tokens == plain.stats.draft_tokens == 0


def test_a_repetitive_prompt_is_drafted_by_prompt_lookup(lookup_nodes):
    (method, _, _), client, _, _ = lookup_nodes
    out = client.generate(REPETITIVE, greedy=True, max_new_tokens=48, num_speculative_tokens=K)
    stats = out.stats
    assert drafted(stats.chosen_k) > 0 and stats.prompt_lookup_tokens > 0
    assert stats.accepted_tokens > 0
    assert max(k for k, count in enumerate(stats.chosen_k) if count) > 1  # adaptive K went past 1
    if method == "prompt-lookup":  # every local draft is prompt lookup's
        assert stats.prompt_lookup_tokens == drafted(stats.chosen_k)


def test_sampled_seeded_requests_are_reproducible_alone_or_together(lookup_nodes):
    """The same tokens one at a time and concurrently (batched where they overlap;
    tests/nodes/test_prompt_lookup_distribution.py checks a batch of them step by step). The K
    chosen may differ, the batch gate deciding batched steps; point masses verified by coupling
    make the tokens those of K = 0 whatever K was."""
    _, client, _, decode = lookup_nodes
    kwargs = dict(max_new_tokens=40, num_speculative_tokens=K, temperature=1.0)
    alone = [client.generate(p, seed=seed, **kwargs) for seed, p in enumerate(PROMPTS)]
    assert alone[0].token_ids == client.generate(PROMPTS[0], seed=0, **kwargs).token_ids
    together: list = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def run(i: int) -> None:
        start.wait()
        together[i] = client.generate(PROMPTS[i], seed=i, **kwargs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [out.token_ids for out in together] == [out.token_ids for out in alone]
    assert [out.token_ids for out in alone] == [
        client.generate(p, seed=seed, **{**kwargs, "num_speculative_tokens": 0}).token_ids
        for seed, p in enumerate(PROMPTS)
    ]
    assert decode.engine.load == 0


def test_node_info_reports_the_method(lookup_nodes):
    (method, lo, hi), client, _, decode = lookup_nodes
    info = decode_info(f"127.0.0.1:{decode.port}")
    assert info.role == "decode"
    assert (info.speculative_method, info.prompt_lookup_min, info.prompt_lookup_max) == (method, lo, hi)
    assert info.adaptive_k  # auto: on for prompt-lookup and hybrid
    prefill = client.info()
    assert prefill.role == "prefill"
    assert (prefill.speculative_method, prefill.prompt_lookup_min, prefill.prompt_lookup_max) == (method, lo, hi)
    assert not prefill.adaptive_k  # the prefill node proposes K (or the match): no acceptance to adapt to


def test_metrics_count_chosen_k_and_lookup_tokens(lookup_nodes):
    """One request at a time on this module's nodes: the deltas are that request's stats."""
    (method, _, _), client, _, decode = lookup_nodes
    by_method = (("method", method),)
    lookup, draft = (("source", "prompt-lookup"),), (("source", "draft"),)
    before = scrape(decode.metrics_port)
    assert ("pdspec_spec_source_draft_tokens_total", lookup) in before  # pre-initialised
    assert ("pdspec_spec_source_draft_tokens_total", draft) in before
    assert ("pdspec_spec_chosen_k_count", by_method) in before
    out = client.generate(REPETITIVE, greedy=True, max_new_tokens=48, num_speculative_tokens=K)
    after = scrape(decode.metrics_port)

    def delta(name, labels):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    stats = out.stats
    assert delta("pdspec_spec_chosen_k_count", by_method) == sum(stats.chosen_k)
    assert delta("pdspec_spec_chosen_k_sum", by_method) == drafted(stats.chosen_k)
    for k in range(K + 1):  # cumulative buckets le="0.0", "1.0", ...
        bucket = ("pdspec_spec_chosen_k_bucket", (("le", f"{float(k)}"), *by_method))
        assert delta(*bucket) == sum(stats.chosen_k[: k + 1]), bucket
    assert delta("pdspec_spec_source_draft_tokens_total", lookup) == stats.prompt_lookup_tokens > 0
    assert 0 < delta("pdspec_spec_source_accepted_tokens_total", lookup) <= stats.prompt_lookup_tokens
    if method == "prompt-lookup":
        assert after[("pdspec_spec_source_draft_tokens_total", draft)] == 0  # no draft model at all
    assert after[("pdspec_spec_source_draft_tokens_total", lookup)] > 0


def test_without_a_match_hybrid_drafts_with_the_model(lookup_nodes):
    """Short novel prompts: no suffix n-gram occurred before. Hybrid falls back to the draft
    model; prompt lookup proposes nothing (and never touches the draft model)."""
    (method, _, _), client, _, decode = lookup_nodes
    draft = ("pdspec_spec_source_draft_tokens_total", (("source", "draft"),))
    before = scrape(decode.metrics_port)[draft]
    for prompt in ("Zq", "xyzzy 0", "Q#"):
        out = client.generate(prompt, greedy=True, max_new_tokens=24, num_speculative_tokens=K)
        plain = client.generate(prompt, greedy=True, max_new_tokens=24, num_speculative_tokens=0)
        assert out.token_ids == plain.token_ids
    after = scrape(decode.metrics_port)[draft]
    if method == "hybrid":
        assert after > before
    else:
        assert after == before == 0


def test_adaptive_k_off_drafts_the_whole_match(pair):
    """--adaptive-k off: every step drafts as deep as the match (up to K); still exact."""
    config = DecodeConfig(spec=SpeculativeConfig(method="prompt-lookup", adaptive_k="off"))
    with cluster(pair, config, PrefillConfig(spec=SpeculativeConfig(method="prompt-lookup"))) as (client, _, decode):
        assert not decode_info(f"127.0.0.1:{decode.port}").adaptive_k
        for prompt in PROMPTS[:3]:
            spec = client.generate(prompt, greedy=True, max_new_tokens=40, num_speculative_tokens=K)
            plain = client.generate(prompt, greedy=True, max_new_tokens=40, num_speculative_tokens=0)
            assert spec.token_ids == plain.token_ids
            assert spec.stats.speculative_method == "prompt-lookup" and drafted(spec.stats.chosen_k) > 0


@pytest.mark.parametrize("layerwise", [False, True], ids=["streamed", "layerwise"])
def test_partial_proposals_over_decode_stream(pair, layerwise):
    """The KV over DecodeStream (the proposal in the last chunk when layer by layer): partial
    and empty lookup proposals arrive and verify as in the one-message path."""
    prefill_config = PrefillConfig(
        spec=SpeculativeConfig(method="prompt-lookup"), kv_streaming=True, kv_layerwise=layerwise
    )
    decode_config = DecodeConfig(spec=SpeculativeConfig(method="prompt-lookup"), step_costs=COSTS)
    with cluster(pair, decode_config, prefill_config) as (client, _, _):
        for prompt in (REPETITIVE, "Zq"):
            spec = client.generate(prompt, greedy=True, max_new_tokens=30, num_speculative_tokens=K)
            plain = client.generate(prompt, greedy=True, max_new_tokens=30, num_speculative_tokens=0)
            assert spec.token_ids == plain.token_ids
            assert spec.stats.speculative_method == "prompt-lookup"


def prefilled_proposal(pair, method: str, prompt: bytes, k: int = K, candidates: int = 1):
    """The prefill engine's DecodeRequest for a greedy request, as the decode node parses it,
    and the context its proposal follows (prompt + first token)."""
    from prefill_node.engine import PrefillEngine
    from protos import pdspec_pb2

    engine = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(method=method)))
    checked = engine.check(
        pdspec_pb2.GenerateRequest(
            prompt_token_ids=list(prompt),
            num_speculative_tokens=k,
            draft_candidates=candidates,
            sampling=pdspec_pb2.SamplingParams(do_sample=False, max_new_tokens=8),
        )
    )
    (prefilled,) = engine.prefill_many([checked])
    wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
    return wire, [*prompt, prefilled.first_token]


@pytest.mark.parametrize("method", ["prompt-lookup", "hybrid"])
def test_the_prefill_node_ships_its_lookup_match(pair, method):
    from engine.prompt_lookup import ContextIndex
    from protos import pdspec_pb2

    for prompt in (REPETITIVE.encode(), CODE.encode() * 2, b"import os\nimport sys\nimport "):
        wire, context = prefilled_proposal(pair, method, prompt)
        match, _ = ContextIndex(context).match(K)
        if not match and method == "hybrid":
            continue  # the draft model's (below)
        assert list(wire.proposal.token_ids) == match
        assert wire.proposal.encoding == pdspec_pb2.Proposal.POINT_MASS and not wire.proposal.parents
        assert wire.proposal.partial == (len(match) < K)
        assert wire.num_speculative_tokens == K


def test_no_match_ships_an_empty_partial_proposal_or_the_drafts(pair):
    from protos import pdspec_pb2

    wire, _ = prefilled_proposal(pair, "prompt-lookup", b"Zq")
    assert list(wire.proposal.token_ids) == [] and wire.proposal.partial
    assert wire.proposal.encoding == pdspec_pb2.Proposal.POINT_MASS
    wire, _ = prefilled_proposal(pair, "hybrid", b"Zq")  # the draft model: K drafts, a full chain
    assert len(wire.proposal.token_ids) == K and not wire.proposal.partial


def test_lookup_candidates_ship_as_a_tree(pair):
    from engine.prompt_lookup import ContextIndex, chains_to_tree

    prompt = b"import a\nimport b\nimport c\nimport"  # then " " (greedy): "import " was followed by a, b, c
    wire, context = prefilled_proposal(pair, "prompt-lookup", prompt, k=3, candidates=3)
    assert context[-1] == ord(" ")
    chains = ContextIndex(context).candidates(3, 3)
    assert chains == [list(b"c\ni"), list(b"b\ni"), list(b"a\ni")]  # most recent first
    ids, parents = chains_to_tree(chains)
    assert list(wire.proposal.token_ids) == ids and list(wire.proposal.parents) == parents
    assert not wire.proposal.partial  # a tree says its own shape
