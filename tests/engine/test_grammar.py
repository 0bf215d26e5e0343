"""engine/grammar.py on the built-in pair's byte vocabulary: masks along a proposal, rollback to
the accepted prefix, jump-forward, guided drafts, compile errors and the cache."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from engine.grammar import GRAMMAR, GrammarError, Grammars, guide, jump_forward
from engine.sequence import Sequence
from protos import pdspec_pb2
from protos.constraint import Constraint
from protos.validation import check_structured_output
from sampling import RequestRng, SamplingParams
from sampling.proposal import LOOKUP, Proposal

SCHEMA = Constraint(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"],
            "additionalProperties": False,
        }
    ),
)


@pytest.fixture(scope="module")
def grammars(pair):
    return Grammars.for_pair(pair)


def allowed(mask: torch.Tensor) -> set[int]:
    return {t for t in range(mask.shape[-1] * 32) if (int(mask[t // 32]) >> (t % 32)) & 1}


def fresh_mask(grammars: Grammars, constraint: Constraint, tokens: list[int]) -> set[int]:
    state = grammars.compile(constraint)
    state.settle(tokens)
    return allowed(state.masks([], [])[0])


def test_masks_follow_the_draft_path_and_a_forbidden_draft_ends_it(grammars):
    state = grammars.compile(SCHEMA)
    ids = [*b'{"n', ord("x"), ord("a")]  # 'x' is forbidden after {"n (the key is "name")
    masks = state.masks(ids, list(range(-1, len(ids) - 1)))
    assert masks.shape == (len(ids) + 1, grammars.words)
    for n in range(3):  # after {, {" and {"n: as a fresh matcher fed the same tokens
        assert allowed(masks[n + 1]) == fresh_mask(grammars, SCHEMA, ids[: n + 1])
    assert ord("x") not in allowed(masks[3])
    assert (masks[4:] == -1).all()  # after the forbidden node: never read, left all-allowed
    assert state.rejected_drafts == 1


def test_tree_masks_are_per_node(grammars):
    state = grammars.compile(Constraint("choice", json.dumps(["cat", "cow", "dog"])))
    ids = [ord("c"), ord("d"), ord("a"), ord("o")]  # c, d at the root; a, o under c
    masks = state.masks(ids, [-1, -1, 0, 0])
    assert allowed(masks[1]) == {ord("a"), ord("o")}  # after c
    assert allowed(masks[2]) == {ord("o")}  # after d
    assert allowed(masks[3]) == {ord("t")}  # after ca
    assert allowed(masks[4]) == {ord("w")}  # after co


def test_settle_rolls_back_to_the_accepted_prefix(grammars):
    constraint = Constraint("regex", "[ab]{2}c[0-9]+")
    state = grammars.compile(constraint)
    state.masks(list(b"abc1"), [-1, 0, 1, 2])  # walked the whole chain
    state.settle(list(b"ab"))  # the first draft accepted, b the correction of the second
    assert allowed(state.masks([], [])[0]) == fresh_mask(grammars, constraint, list(b"ab")) == {ord("c")}
    state.masks(list(b"c12"), [-1, 0, 1])
    state.settle(list(b"c4"))  # the first draft accepted, the second rejected, 4 its correction
    assert allowed(state.masks([], [])[0]) == fresh_mask(grammars, constraint, list(b"abc4"))


def test_jump_forward_proposes_the_forced_tokens(grammars):
    state = grammars.compile(SCHEMA)
    forced = jump_forward(state, 16)
    assert forced is not None and forced.source == GRAMMAR and forced.probs is None
    assert bytes(forced.token_ids) == b'{"name":"'
    assert forced.parents == list(range(-1, len(forced.token_ids) - 1))
    assert jump_forward(state, 3).token_ids == list(b'{"n')
    assert jump_forward(None, 4) is None


def test_guide_cuts_a_point_mass_chain_only(grammars):
    state = grammars.compile(Constraint("regex", "[0-9]+"))
    cut = guide(state, Proposal(list(b"12a3"), [-1, 0, 1, 2], None, LOOKUP))
    assert cut.token_ids == list(b"12") and cut.parents == [-1, 0] and cut.source == LOOKUP
    law = torch.full((4, 257), 1 / 257)
    whole = Proposal(list(b"12a3"), [-1, 0, 1, 2], law)
    assert guide(state, whole) is whole  # a drawn law is verified as drawn


def test_a_sequence_ends_with_stop_when_its_grammar_completes(grammars):
    def sequence(constraint):
        return Sequence(
            prompt=[1],
            params=SamplingParams(),
            budget=50,
            eos_token_ids=(256,),
            stop_token_ids=(),
            rng=RequestRng(0),
            grammar=grammars.compile(constraint),
        )

    done = sequence(Constraint("choice", json.dumps(["yes", "no"])))
    assert done.append(list(b"ye")) == (list(b"ye"), "")
    assert done.append(list(b"s")) == (list(b"s"), "stop")  # nothing can follow: it ends there
    open_ended = sequence(Constraint("regex", "a+"))
    assert open_ended.append([*b"aa", 256]) == ([*b"aa", 256], "stop")  # EOS where the grammar accepts


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pdspec_pb2.StructuredOutput(regex="(unclosed"), "structured_output.regex"),
        (pdspec_pb2.StructuredOutput(grammar="start: undefined_rule"), "structured_output.grammar"),
        (pdspec_pb2.StructuredOutput(json_schema='{"type": "no-such-type"}'), "structured_output.json_schema"),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(grammars, message, field):
    found = []
    constraint = check_structured_output(message, found)
    assert not found
    with pytest.raises(GrammarError) as err:
        grammars.compile(constraint)
    assert err.value.field == field and err.value.message


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pdspec_pb2.StructuredOutput(json_object=False), "structured_output.json_object"),
        (pdspec_pb2.StructuredOutput(json_schema="[1, 2]"), "structured_output.json_schema"),
        (pdspec_pb2.StructuredOutput(json_schema="{not json"), "structured_output.json_schema"),
        (pdspec_pb2.StructuredOutput(choice=pdspec_pb2.ChoiceList(values=[])), "structured_output.choice"),
        (pdspec_pb2.StructuredOutput(choice=pdspec_pb2.ChoiceList(values=["a", "a"])), "structured_output.choice"),
        (pdspec_pb2.StructuredOutput(regex="a" * 70_000), "structured_output.regex"),
    ],
)
def test_malformed_constraints_are_violations(message, field):
    found = []
    assert check_structured_output(message, found) is None
    assert [v.field for v in found] == [field]


def test_compiled_grammars_are_cached_and_matchers_independent(grammars):
    first = grammars.compile(SCHEMA)
    spent = grammars.compile_seconds
    second = grammars.compile(SCHEMA)
    assert grammars.compile_seconds == spent  # the cache answered
    first.settle(list(b'{"name":"'))
    assert allowed(second.masks([], [])[0]) == {ord("{")}


def test_a_compile_past_the_time_limit_is_refused(grammars, monkeypatch):
    """Two builds that overrun hold the compile pool: the next one cannot start, and its caller
    is refused once the limit passes, not held."""
    import engine.grammar

    monkeypatch.setattr(engine.grammar, "COMPILE_TIMEOUT_S", 0.2)
    release = threading.Event()
    held = [engine.grammar._COMPILERS.submit(release.wait) for _ in range(2)]
    try:
        with pytest.raises(GrammarError) as err:
            grammars.compile(Constraint("regex", "[a-z]{1,40}(,[a-z]{1,40}){0,30}"))
    finally:
        release.set()
    assert err.value.field == "structured_output.regex" and "within 0.2 s" in err.value.message
    for future in held:
        future.result()
    assert grammars.compile(Constraint("regex", "x")).masks([], []).shape[0] == 1  # the engine serves on
