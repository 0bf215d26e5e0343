"""Prompt lookup with adaptive K samples exactly from the target: the joint distribution of
the first 3 tokens over 20,000 seeded requests at temperature 1 matches the n-gram target's
exact probabilities (chi-square, alpha = 1e-6, as tests/nodes/test_distribution.py). Both
nodes propose by prompt lookup: the prefill node ships a partial POINT_MASS chain (as long
as its match), the decode node verifies it, then drafts its own at the K adaptive K picks
from a fixed cost table. Requests go through the real prefill engine, serialized
DecodeRequests, the validator and the batched decode engine (tests/nodes/harness.py's
pipeline; the transport is covered by tests/nodes/test_prompt_lookup_nodes.py).

The test has the power to see a wrong verifier: the same pipeline with the acceptance uniforms
of both kernels scaled (checked when this was written, not kept here) gave p = 0 with every
draft accepted, p ~ 4e-169 with drafts accepted at twice the target's odds and p ~ 7e-13 at
1.25 times; and a decode node that drafted only when the step's first uniform was below 0.5
(K reading the step's own randomness, not just the past) gave p ~ 3e-102. The real one: p ~ 0.11."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from decode_node.engine import DecodeConfig, DecodeEngine
from engine.adaptive import StepCosts
from engine.spec_config import SpeculativeConfig
from models.pair import ModelPair
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import DecodeInput, Receiver, validate_decode_request
from sampling import Verifier
from tests.nodes.harness import exact_joint, memoized
from tests.nodes.test_distribution import SAMPLES, joint_pvalue
from tests.sampling.helpers import ALPHA

TOKENS = 3  # the joint law of the first 3 tokens
K = 4
PROMPT = list(b"os\nimport ")  # varied continuations; most first tokens occurred in the prompt
LOOKUP = dict(method="prompt-lookup", prompt_lookup_min=1, prompt_lookup_max=3)
COSTS = StepCosts((1.0, 1.3, 1.5, 1.7, 1.9))  # fixed (no start-up timing): K = 2 at first, 0 after a rejection


class Seen:
    """What the requests went through: the paths this test is about were taken."""

    def __init__(self) -> None:
        self.partial = 0  # prefill proposals shipped partial (fewer than K ids)
        self.shipped = collections.Counter()  # prefill proposals by length
        self.chosen_k = collections.Counter()  # the decode node's steps by the K chosen
        self.lookup_tokens = 0  # the decode node's own lookup drafts


def generate_lookup(
    pair: ModelPair,
    prompt: Sequence[int],
    seeds: Sequence[int],
    *,
    max_new_tokens: int,
    batch: int | None = None,
    verifier: Verifier | None = None,
    k: int = K,
) -> tuple[list[list[int]], Seen]:
    """Token lists (first token included) of one seeded temperature-1 request per seed, both
    nodes proposing by prompt lookup, adaptive K on at the decode node, each request's K cap `k`.
    `batch`: requests per decode step (default: all at once)."""
    seen = Seen()
    prefill = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(**LOOKUP)))
    decode = DecodeEngine(
        pair,
        DecodeConfig(
            spec=SpeculativeConfig(max_speculative_tokens=K, adaptive_k="on", **LOOKUP),
            max_batch=batch or len(seeds),
            max_queue=len(seeds),
            step_costs=COSTS,
        ),
        verifier=verifier,
    )
    receiver = Receiver.from_contract(pair.contract(), K)
    requests = [
        prefill.check(
            pdspec_pb2.GenerateRequest(
                request_id=str(seed),
                prompt_token_ids=list(prompt),
                num_speculative_tokens=k,
                sampling=pdspec_pb2.SamplingParams(
                    do_sample=True, temperature=1.0, seed=seed, max_new_tokens=max_new_tokens
                ),
            )
        )
        for seed in seeds
    ]
    firsts, handles = [], []
    for prefilled in prefill.prefill_many(requests):
        firsts.append(prefilled.first_token)
        if prefilled.finish_reason:
            handles.append(None)
            continue
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        seen.partial += wire.proposal.partial
        seen.shipped[len(wire.proposal.token_ids)] += 1
        decoded = validate_decode_request(wire, receiver)
        assert isinstance(decoded, DecodeInput), decoded
        handles.append(decode.submit(decoded))
    while decode.load:
        decode.step()
    outputs = []
    for first, handle in zip(firsts, handles, strict=True):
        out = [first]
        while handle is not None and not handle.events.empty():
            event = handle.events.get()
            out += event.tokens
            if event.stats is not None:
                seen.chosen_k.update(dict(enumerate(event.stats.chosen_k)))
                seen.lookup_tokens += event.stats.prompt_lookup_tokens
        outputs.append(out)
    return outputs, seen


def test_prompt_lookup_with_adaptive_k_keeps_the_targets_law(pair):
    outputs, seen = generate_lookup(memoized(pair), PROMPT, range(SAMPLES), max_new_tokens=TOKENS)
    assert all(len(out) == TOKENS for out in outputs)
    # The paths under test were taken, often: partial chains from the prefill node (empty ones
    # too), full ones, and the decode node's own lookups at the K it chose, 0 included.
    assert seen.partial > SAMPLES // 4 and seen.shipped[0] > SAMPLES // 10 and seen.shipped[K] > SAMPLES // 10
    assert seen.chosen_k[0] > SAMPLES // 10 and seen.chosen_k[2] > SAMPLES // 10
    assert seen.lookup_tokens > SAMPLES // 2
    assert joint_pvalue(outputs, exact_joint(pair, PROMPT, TOKENS, SAMPLES)) > ALPHA


def test_a_seeded_request_draws_the_same_tokens_in_any_batch(pair):
    """Adaptive K reads only the request's own history and the fixed table: 32 seeded requests
    of 20 tokens, one per step (the chain kernel) or all in each step (mixed lengths: the tree
    kernel), draw the same tokens: those of K = 0 (point masses are verified by coupling)."""
    seeds = range(32)
    alone, _ = generate_lookup(pair, PROMPT, seeds, max_new_tokens=20, batch=1)
    together, seen = generate_lookup(pair, PROMPT, seeds, max_new_tokens=20)
    assert together == alone
    assert sum(len(out) == 20 for out in alone) > 24  # most run to the length limit (some sample the end)
    assert sum(count for k, count in seen.chosen_k.items() if k) > 8  # drafted steps, not all K = 0
    plain, _ = generate_lookup(pair, PROMPT, seeds, max_new_tokens=20, k=0)
    assert plain == alone
