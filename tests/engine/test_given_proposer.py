"""A DecodeEngine given its own proposer drafts with it instead of the config's (the seam a
benchmark drafts through at a known acceptance rate): every step after the first verifies
its proposals, and a greedy request still emits its K = 0 tokens."""

from __future__ import annotations

from decode_node.engine import DecodeConfig, DecodeEngine
from engine.proposer import Plan, Proposer
from engine.spec_config import SpeculativeConfig
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import Receiver, validate_decode_request
from sampling.proposal import DRAFT, LOOKUP, NO_PROPOSAL, Proposal


class Repeating:
    """Proposes the last token again at every depth (point masses, chains); counts the rows it
    drafted for. A proposer of its own (the `Proposer` protocol), with no per-request state."""

    method, trees, max_tree_nodes, uses_draft, match_driven = "repeating", False, 64, False, False
    sources = (DRAFT,)

    def __init__(self) -> None:
        self.rows = 0

    def start(self, rows, kv_needs) -> None:
        pass

    def stop(self, row) -> None:
        pass

    def plan(self, rows, caps):
        return [Plan(DRAFT, cap) for cap in caps]

    def max_nodes(self, depth: int, candidates: int) -> int:
        return depth

    def propose(self, rows, plans, depths):
        self.rows += sum(1 for depth in depths if depth)
        return [
            Proposal([row.history[-1]] * depth, list(range(-1, depth - 1)), None) if depth else NO_PROPOSAL
            for row, depth in zip(rows, depths, strict=True)
        ]


def generate(pair, k: int, proposer: Proposer | None = None):
    """A greedy request through the prefill engine and a decode engine (given `proposer`):
    its tokens and the decode node's statistics."""
    prefill = PrefillEngine(pair, PrefillConfig())
    decode = DecodeEngine(pair, DecodeConfig(spec=SpeculativeConfig(max_speculative_tokens=4)), proposer=proposer)
    request = pdspec_pb2.GenerateRequest(
        prompt_token_ids=list(b"for key, value in "),
        num_speculative_tokens=k,
        sampling=pdspec_pb2.SamplingParams(do_sample=False, max_new_tokens=24),
    )
    prefilled = prefill.prefill(prefill.check(request))
    wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
    handle = decode.submit(validate_decode_request(wire, Receiver.from_contract(pair.contract(), 4)))
    while decode.load:
        decode.step()
    tokens, stats = [prefilled.first_token], None
    while not handle.events.empty():
        event = handle.events.get()
        assert not event.error, event.error
        tokens += event.tokens
        stats = event.stats or stats
    return tokens, stats


def test_a_given_proposer_drafts_every_step_after_the_first(pair):
    plain, _ = generate(pair, 0)
    repeating = Repeating()
    tokens, stats = generate(pair, 3, repeating)
    assert tokens == plain and len(tokens) == 24
    assert repeating.rows > 0
    assert stats.verify_steps == repeating.rows + 1  # the first step verified the prefill node's proposal
    assert stats.draft_tokens == 3 * stats.verify_steps
    assert DecodeEngine(pair, DecodeConfig(), proposer=repeating).proposer is repeating
    none_given = DecodeEngine(pair, DecodeConfig(spec=SpeculativeConfig(method="prompt-lookup")))
    assert none_given.proposer.method == LOOKUP  # the config's
