"""Async scheduling (decode_node/engine.py): a K = 0 step queued before the step before it is
read gives the tokens of the synchronous engine, token for token and seed for seed, alone and
in a batch; rows that finish or are cancelled while a step is in flight drop its token and
give back every KV block; a speculating row in the batch makes the step wait, and it still
matches. On the CPU (the same code path as a GPU's, with no overlap to gain)."""

from __future__ import annotations

import random
import threading
from concurrent import futures

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from decode_node.engine import DecodeConfig, DecodeEngine
from decode_node.request import QueueFull
from engine.adaptive import PRIOR, BatchGate, StepCosts
from engine.paged_lm import paged_pair
from engine.prompt_lookup import ContextIndex
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import Receiver, validate_decode_request
from sampling.proposal import DRAFT, LOOKUP, PREFILL
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer
from tests.nodes.conftest import cluster, wait_until


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("async-llama"), "llama", seed=3, layers=2)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    return paged_pair(load_pair(target_model=path, draft_layers=1, dtype=torch.float32), 8 << 20)


def request(prompt: int, *, k: int = 0, seed: int | None = None, max_new: int = 24, stop=(), logprobs=0):
    sampling = pdspec_pb2.SamplingParams(
        do_sample=seed is not None,
        temperature=0.9,
        max_new_tokens=max_new,
        stop_token_ids=list(stop),
        logprobs=logprobs,
    )
    if seed is not None:
        sampling.seed = seed
    return pdspec_pb2.GenerateRequest(
        prompt_token_ids=list(range(3, 3 + prompt)), num_speculative_tokens=k, sampling=sampling
    )


def run(
    pair,
    requests,
    scheduling: str,
    *,
    cancel_after: dict[int, int] | None = None,
    method: str = "draft",
    gate: str = "off",
    max_batch: int = 8,
    preempt_after_steps: int = 0,
    measured: bool = False,
    ahead: str = "on",
):
    """The requests through a prefill engine and a decode engine stepped by hand: per request,
    (tokens, finish reason); `cancel_after` {request: steps} cancels it after that many steps.
    `run.computed`: the target positions the decode engine ran. gate: no batch gate ("off":
    adaptive K must not depend on timings here), or one that starts out having measured K = 0
    steps as the faster kind at every batch size ("plain-faster"). measured: adaptive K's cost
    table measured on the pair at start-up, as a node does by default, instead of configured."""
    prefill = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(method=method)))
    config = DecodeConfig(
        spec=SpeculativeConfig(max_speculative_tokens=4, method=method),
        max_batch=max_batch,
        async_scheduling=scheduling,
        speculate_ahead=ahead,
        preempt_after_steps=preempt_after_steps,
        step_costs=None if measured else StepCosts((1.0, 1.2, 1.3, 1.4, 1.5)),
    )
    decode = DecodeEngine(pair, config)
    decode.calibrate()
    assert decode.config.pipelined == (scheduling == "on")
    if gate == "off":
        decode.policy.gate = None
    elif gate == "plain-faster":  # a speculating step 100x a K = 0 one: no acceptance pays for it
        for batch in (1, 2, 4, 8):
            for speculated, seconds in ((True, 100.0), (True, 100.0), (False, 1.0), (False, 1.0)):
                decode.policy.gate.record(batch, speculated, seconds)
    receiver = Receiver.from_contract(pair.contract(), 4)
    running, out = [], []
    for prefilled in prefill.prefill_many([prefill.check(r) for r in requests]):
        # an unseeded sampled row may draw a stop id first: it ends at the prefill node
        out.append(([prefilled.first_token], prefilled.finish_reason) if prefilled.finish_reason else ([], ""))
        if prefilled.finish_reason:
            running.append((None, None))
            continue
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        first = prefilled.decode_request.first_token_id
        running.append((decode.submit(validate_decode_request(wire, receiver)), [first]))
    steps, computed, run.pipelined, run.ahead = 0, pair.target.positions_computed, 0, 0
    run.stats = [None] * len(running)  # None: ended at the prefill node, never verified
    while decode.load or any(not reason for _, reason in out):
        decode.step()
        run.pipelined += decode._inflight is not None
        run.ahead += decode._inflight is not None and any(p.token_ids for p in decode._inflight.queued.proposals)
        steps += 1
        assert steps < 500
        for i, (req, tokens) in enumerate(running):
            if req is None:
                continue
            seq = req.seq
            if seq.target_state is not None:  # the target has consumed history but its last
                assert seq.target_state.tokens[: len(seq.history) - 1] == seq.history[:-1]
            if (cancel_after or {}).get(i) == steps:
                decode.cancel(req)
            while not req.events.empty():
                event = req.events.get()
                assert not event.error, event.error
                tokens += event.tokens
                if event.finished:
                    out[i] = (tokens, event.finish_reason)
                    run.stats[i] = event.stats
            if req.cancelled.is_set() and not out[i][1] and (cancel_after or {}).get(i):
                out[i] = (tokens, "cancelled")
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0
    run.computed = pair.target.positions_computed - computed
    run.preemptions = decode.fairness.preemptions
    return out


def test_greedy_and_seeded_rows_give_the_synchronous_tokens(pair):
    requests = [request(5 + 3 * i, seed=None if i % 2 else i, max_new=10 + 3 * i) for i in range(6)]
    sync = run(pair, requests, "off")
    computed = run.computed
    pipelined = run(pair, requests, "on")
    assert pipelined == sync
    assert run.computed == computed  # a row's last step is known ahead: no step runs past max_new_tokens
    assert [len(t) for t, _ in sync] == [10 + 3 * i for i in range(6)] and {r for _, r in sync} == {"length"}


def test_a_row_that_stops_while_a_step_is_in_flight_drops_its_token(pair):
    """A stop token ends the row in the step read while the next is queued: that next token is
    not emitted, and the row's blocks come back once it is read (checked in run)."""
    (tokens, _), *_ = run(pair, [request(7, max_new=20)], "off")
    stop = tokens[6]  # a stop token in the middle of the greedy continuation
    cut = tokens.index(stop) + 1
    requests = [request(7, max_new=20, stop=[stop]), request(9, seed=4, max_new=12), request(4, max_new=2)]
    sync, pipelined = run(pair, requests, "off"), run(pair, requests, "on")
    assert pipelined == sync
    assert pipelined[0] == (tokens[:cut], "stop") and pipelined[2][1] == "length" and len(pipelined[2][0]) == 2


@pytest.mark.parametrize("scheduling", ["off", "on"])
def test_preempted_rows_resume_with_the_same_tokens(pair, scheduling):
    """Six requests for two slots, a row preempted after 3 steps while others wait: its paged KV
    is freed and recomputed when it comes back (with async scheduling, once the queued step
    that holds it is read), and every row gives the tokens of the unpreempted run."""
    requests = [request(5 + 3 * i, k=4 * (i % 2), seed=None if i % 3 else i, max_new=16) for i in range(6)]
    alone = run(pair, requests, "off")
    preempted = run(pair, requests, scheduling, max_batch=2, preempt_after_steps=3)
    assert run.preemptions > 0
    assert preempted == alone


def test_cancelled_rows_give_back_their_blocks(pair):
    requests = [request(6 + i, seed=i, max_new=40) for i in range(4)]
    out = run(pair, requests, "on", cancel_after={0: 1, 2: 5})
    assert out[0][1] == out[2][1] == "cancelled" and {r for _, r in (out[1], out[3])} == {"length"}
    assert len(out[2][0]) < 40 and [len(t) for t, _ in (out[1], out[3])] == [40, 40]


def test_speculating_and_logprob_rows_make_the_step_wait_and_still_match(pair):
    requests = [
        request(5, max_new=16),
        request(8, k=3, max_new=16),  # joins a pipelined batch: every step then waits for the one before
        request(6, seed=9, max_new=16, logprobs=2),
        request(10, seed=1, max_new=16),
    ]
    assert run(pair, requests, "on") == run(pair, requests, "off")


def test_prompt_lookup_rows_pipeline_while_they_cannot_draft_and_match_the_synchronous_engine(pair):
    """Whether a prompt-lookup row may draft is decided from its context two steps back, so rows
    without a match pipeline, rows with one wait for the step before and speculate, and the
    tokens (greedy and seeded, adaptive K on) are those of the synchronous engine."""
    repeated = [pdspec_pb2.GenerateRequest(prompt_token_ids=[*range(3, 12), *range(3, 12)], num_speculative_tokens=4)]
    repeated[0].sampling.max_new_tokens = 30
    requests = [*repeated, request(5, k=4, max_new=30), request(7, k=4, seed=2, max_new=30), request(6, max_new=20)]
    sync = run(pair, requests, "off", method="prompt-lookup")
    pipelined = run(pair, requests, "on", method="prompt-lookup")
    assert pipelined == sync and run.pipelined > 0
    assert run.stats[0].prompt_lookup_tokens > 0 and sum(run.stats[0].chosen_k[1:]) > 0  # it did speculate
    plain = run(pair, [request(5, max_new=30)], "off")
    assert sync[1] == plain[0]  # greedy prompt lookup emits the K = 0 tokens


def looping(copies: int, k: int = 4, max_new: int = 30, stop=(), seed: int | None = None) -> pdspec_pb2.GenerateRequest:
    """A request whose prompt repeats a phrase, greedy (or sampled with `seed`): prompt lookup
    finds matches from its start."""
    out = pdspec_pb2.GenerateRequest(prompt_token_ids=[*range(3, 12)] * copies, num_speculative_tokens=k)
    out.sampling.max_new_tokens = max_new
    out.sampling.stop_token_ids.extend(stop)
    if seed is not None:
        out.sampling.do_sample, out.sampling.temperature, out.sampling.seed = True, 0.9, seed
    return out


def test_greedy_prompt_lookup_rows_draft_ahead_of_the_step_in_flight_and_emit_the_synchronous_tokens(pair):
    """Greedy prompt-lookup rows speculate in steps queued before the step in flight is read,
    each drafting on the context that step would leave if it accepted all its drafts; the
    device moves each step back by what the step before rejected. Every row (short budgets,
    a stop token, a K = 0 row, a row that joins late) gives the synchronous engine's tokens,
    drafts were accepted and rejected in those steps, and every block comes back (run)."""
    (tokens, _), *_ = run(pair, [request(7, max_new=20)], "off")
    requests = [
        looping(2),
        request(5, k=4, max_new=30),
        looping(3, max_new=3),  # its budget ends inside a step's drafts
        request(7, k=4, max_new=20, stop=[tokens[9]]),
        request(6, max_new=12),  # K = 0
        looping(2, k=2, max_new=40),
    ]
    sync = run(pair, requests, "off", method="prompt-lookup")
    ahead = run(pair, requests, "on", method="prompt-lookup")
    assert ahead == sync and run.ahead > 0
    stats = [s for s in run.stats if s is not None]
    assert sum(s.accepted_tokens for s in stats) > 0 and sum(s.draft_tokens - s.accepted_tokens for s in stats) > 0
    assert sync[3][1] == "stop" and len(sync[2][0]) == 3
    late = run(pair, requests, "on", method="prompt-lookup", max_batch=2)  # rows join while others are in flight
    assert late == sync and run.ahead > 0
    off = run(pair, requests, "on", method="prompt-lookup", ahead="off")  # --speculate-ahead off
    assert off == sync and run.ahead == 0 and run.pipelined > 0


def test_sampled_rows_draft_ahead_and_draw_the_synchronous_engines_tokens(pair):
    """Seeded sampled prompt-lookup rows draft ahead too: verified by coupling at positions the
    device moves back with the KV, each emits the tokens the synchronous engine (and K = 0)
    draws for its seed, beside greedy rows, a sampled K = 0 row and a row that stops."""
    (tokens, _), *_ = run(pair, [request(7, seed=5, max_new=20)], "off")
    requests = [
        looping(2, seed=1),
        looping(3, k=2, seed=2, max_new=40),
        looping(2),
        request(7, k=4, seed=5, max_new=20, stop=[tokens[9]]),
        request(6, seed=6, max_new=12),  # K = 0
        looping(3, seed=3, max_new=3),  # its budget ends inside a step's drafts
    ]
    sync = run(pair, requests, "off", method="prompt-lookup")
    ahead = run(pair, requests, "on", method="prompt-lookup")
    assert ahead == sync and run.ahead > 0
    assert sum(s.draft_tokens for s in (run.stats[0], run.stats[1])) > 0  # the sampled rows drafted
    assert sync[3][1] == "stop"
    plain = run(pair, [request(7, seed=5, max_new=20, stop=[tokens[9]])], "off")
    assert sync[3] == plain[0]  # coupled: the K = 0 tokens


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "sampled"])
def test_drafting_ahead_with_drafts_right_and_wrong_at_random_keeps_every_token(pair, monkeypatch, seeded):
    """Prompt lookup replaced by a guesser that knows each row's K = 0 continuation (greedy, or
    drawn for its seed) and gets every draft wrong with probability 0.1 (and guesses at random
    where the step in flight's guess failed): most steps accept some drafts and reject the rest
    while the next step is already queued, so the device's moves (of the KV and of a sampled
    row's positions) and the host's drops run step after step. The tokens of K = 0 come out all
    the same."""
    from engine.prompt_lookup import ContextIndex

    requests = [request(5 + 2 * i, k=4, max_new=30 + 3 * i, seed=i if seeded else None) for i in range(4)]
    truth = {
        tuple(r.prompt_token_ids): tokens
        for r, (tokens, _) in zip(requests, run(pair, [replace_k(r, 0) for r in requests], "off"), strict=True)
    }
    rng = random.Random(7)

    def guess(self, k, tail=()):
        context = [*self.tokens, *tail]
        prompt = max((p for p in truth if tuple(context[: len(p)]) == p), key=len)  # the prompts nest
        emitted, greedy = context[len(prompt) :], truth[prompt]
        right = greedy[: len(emitted)] == emitted
        cont = [t if right and rng.random() > 0.1 else rng.randrange(2, 90) for t in greedy[len(emitted) :][:k]]
        return cont, 2 if cont else 0

    monkeypatch.setattr(ContextIndex, "match", guess)
    ahead = run(pair, requests, "on", method="prompt-lookup")
    assert [tokens for tokens, _ in ahead] == list(truth.values()) and run.ahead > 8
    drafted = sum(s.draft_tokens for s in run.stats)
    assert 0.2 * drafted < sum(s.accepted_tokens for s in run.stats) < 0.8 * drafted


def test_a_batch_of_k0_rows_is_a_plain_queued_step_with_speculate_ahead_on(pair, monkeypatch):
    """Drafting ahead needs a row that may draft: K = 0 rows alone pipeline as plain steps, with
    no matching and no gate, and give the synchronous tokens."""
    calls = []
    real = DecodeEngine._ahead
    monkeypatch.setattr(DecodeEngine, "_ahead", lambda self, *args: calls.append(1) or real(self, *args))
    requests = [request(5, max_new=12), request(7, seed=2, max_new=12)]
    queued = run(pair, requests, "on", method="prompt-lookup")
    assert not calls and run.pipelined > 0
    assert queued == run(pair, requests, "off", method="prompt-lookup")
    run(pair, [*requests, looping(2)], "on", method="prompt-lookup")
    assert calls  # a row that may draft: the batch drafts ahead


def test_rows_preempted_while_drafting_ahead_resume_with_the_same_tokens(pair):
    """Six prompt-lookup rows (greedy and seeded) for two slots, preempted after 3 steps while a
    step drafting ahead may hold them: each resumes with the synchronous engine's tokens."""
    requests = [looping(2 + i % 2, seed=None if i % 3 == 0 else i, max_new=24) for i in range(6)]
    alone = run(pair, requests, "off", method="prompt-lookup")
    preempted = run(pair, requests, "on", method="prompt-lookup", max_batch=2, preempt_after_steps=3)
    assert run.preemptions > 0 and run.ahead > 0
    assert preempted == alone


def replace_k(message: pdspec_pb2.GenerateRequest, k: int) -> pdspec_pb2.GenerateRequest:
    out = pdspec_pb2.GenerateRequest()
    out.CopyFrom(message)
    out.num_speculative_tokens = k
    return out


def test_rows_whose_guesses_fail_stop_drafting_after_them_and_keep_their_tokens(pair, monkeypatch):
    """A guesser whose drafts continue each row's greedy text but whose guess of the token in
    flight is always wrong: every draft made after a guess is rejected, so adaptive K prices
    them with the row's rate of right guesses and soon drafts none there. The tokens are K = 0's."""
    from engine.prompt_lookup import ContextIndex

    requests = [request(5 + 2 * i, k=4, max_new=40) for i in range(3)]
    truth = {
        tuple(r.prompt_token_ids): tokens for r, (tokens, _) in zip(requests, run(pair, requests, "off"), strict=True)
    }

    def guess(self, k, tail=()):
        context = [*self.tokens, *tail]
        prompt = max((p for p in truth if tuple(context[: len(p)]) == p), key=len)
        emitted, greedy = context[len(prompt) :], truth[prompt]
        if k == 1:  # the guess of the token in flight (drafts are asked for 4)
            return [(greedy[len(emitted)] + 1) % 90 if len(emitted) < len(greedy) else 3], 2
        return (greedy[len(emitted) :][:k] if greedy[: len(emitted)] == emitted else [5] * k), 2

    monkeypatch.setattr(ContextIndex, "match", guess)
    ahead = run(pair, requests, "on", method="prompt-lookup")
    assert [tokens for tokens, _ in ahead] == list(truth.values())
    drafted = sum(s.draft_tokens for s in run.stats)
    assert drafted < 100, drafted  # fresh rows' and probes' drafts (36), not 4 a step (357 unpriced)


def test_rows_cancelled_while_a_step_drafting_ahead_is_in_flight_give_back_their_blocks(pair):
    requests = [request(5, k=4, max_new=40), looping(2, max_new=40), request(9, k=4, max_new=40)]
    whole = run(pair, requests, "on", method="prompt-lookup")
    out = run(pair, requests, "on", method="prompt-lookup", cancel_after={0: 6, 2: 9})
    assert out[0][1] == out[2][1] == "cancelled" and out[1] == whole[1] and run.ahead > 0


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_the_batch_gate_holds_rows_whose_tokens_do_not_depend_on_k(pair, scheduling):
    """Where the node measured K = 0 steps as faster at a batch size, a batch of prompt-lookup
    rows runs at K = 0 (queued, with async scheduling), seeded sampled rows included and the
    prefill's proposals dropped: verified by coupling, every row emits the tokens of an engine
    that never gates."""
    twice = [*range(3, 12), *range(3, 12)]  # greedy, the target continues it with 2: the prefill ships 3, 4, 5, 6
    repeated = pdspec_pb2.GenerateRequest(prompt_token_ids=[*twice, 2, *twice], num_speculative_tokens=4)
    repeated.sampling.max_new_tokens = 30
    for batch in ([repeated, request(5, k=4, max_new=30)], [repeated, request(7, k=4, seed=2, max_new=30)]):
        held = run(pair, batch, scheduling, method="prompt-lookup", gate="plain-faster")
        assert sum(s.verify_steps for s in run.stats) == 0  # every step held, the first (the prefill's proposal) too
        if scheduling == "on":
            assert run.pipelined > 0
        free = run(pair, batch, scheduling, method="prompt-lookup")
        assert held == free and run.stats[0].prompt_lookup_tokens > 0  # ungated, the repeated prompt drafts


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_a_row_alone_is_gated_only_where_the_node_measured_its_step_costs(pair, scheduling):
    """A row alone in the batch is priced by the gate too when the cost table was measured on
    this node (what its steps really take, host work and read-backs included, is what the
    start-up table leaves out), and not when the table was configured (then the table is the
    whole policy). Held, it emits the tokens of the engine that drafts."""
    twice = [*range(3, 12), *range(3, 12)]
    repeated = pdspec_pb2.GenerateRequest(prompt_token_ids=[*twice, 2, *twice], num_speculative_tokens=4)
    repeated.sampling.max_new_tokens = 30
    held = run(pair, [repeated], scheduling, method="prompt-lookup", gate="plain-faster", measured=True)
    assert run.stats[0].verify_steps == 0
    configured = run(pair, [repeated], scheduling, method="prompt-lookup", gate="plain-faster")
    assert run.stats[0].verify_steps > 0 and run.stats[0].prompt_lookup_tokens > 0
    assert held == configured


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_the_batch_gate_prices_model_drafts_and_never_moves_a_seeded_row(pair, scheduling):
    """Model drafts too (hybrid: these contexts rarely match, so the draft model proposes): where
    K = 0 steps measured faster, a batch of greedy and unseeded sampled rows runs at K = 0 (the
    draft model not run), the greedy rows emitting the tokens of an engine that never gates. A
    seeded sampled row's tokens depend on K with model drafts: a batch holding one is not gated,
    and gives the ungated engine's tokens, seed for seed."""
    unseeded = request(6, k=4, max_new=20)
    unseeded.sampling.do_sample = True
    greedy = [request(5, k=4, max_new=20), request(9, k=4, max_new=20)]
    held = run(pair, [*greedy, unseeded], scheduling, method="hybrid", gate="plain-faster")
    assert sum(s.verify_steps for s in run.stats if s) == 0  # every step held, the first (the prefill's proposal) too
    free = run(pair, [*greedy, unseeded], scheduling, method="hybrid")
    assert held[:2] == free[:2] and sum(s.verify_steps for s in run.stats if s) > 0
    seeded = [*greedy, request(7, k=4, seed=3, max_new=20)]
    gated = run(pair, seeded, scheduling, method="hybrid", gate="plain-faster")
    assert sum(s.verify_steps for s in run.stats if s) > 0
    assert gated == run(pair, seeded, scheduling, method="hybrid")


def repeated_request(max_new: int = 30) -> pdspec_pb2.GenerateRequest:
    """A greedy prompt-lookup request whose context repeats: it has a match at every step."""
    twice = [*range(3, 12), *range(3, 12)]
    repeated = pdspec_pb2.GenerateRequest(prompt_token_ids=[*twice, 2, *twice], num_speculative_tokens=4)
    repeated.sampling.max_new_tokens = max_new
    return repeated


def counting_lookups(monkeypatch) -> list[int]:
    """Every prompt-lookup match any engine makes from now on appends to the returned list."""
    looked, match = [], ContextIndex.match
    monkeypatch.setattr(ContextIndex, "match", lambda self, *args, **kw: looked.append(1) or match(self, *args, **kw))
    return looked


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_a_batch_held_even_at_its_rows_best_looks_up_nothing_and_keeps_its_tokens(pair, scheduling, monkeypatch):
    """Where even each row's best (all its K drafts offered, at its acceptance) does not pay for
    a speculating step, the gate holds the batch without looking up what the rows' contexts
    offer: no match is made after the prefill node's proposals, and every row emits the tokens
    of the engine that looks up and drafts at every step."""
    batch = [repeated_request(), request(5, k=4, max_new=30)]
    looked = counting_lookups(monkeypatch)
    held = run(pair, batch, scheduling, method="prompt-lookup", gate="plain-faster")
    assert sum(s.verify_steps for s in run.stats) == 0
    held_lookups = len(looked)
    looked.clear()
    free = run(pair, batch, scheduling, method="prompt-lookup")
    assert held == free and run.stats[0].prompt_lookup_tokens > 0
    assert held_lookups <= 2 * len(batch) < 20 <= len(looked)  # the prefill node's (a plan and a proposal a request)


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_rows_held_without_lookups_look_up_and_draft_once_the_gate_lets_them(pair, scheduling, monkeypatch):
    """Rows whose contexts grew unlooked-up while the gate held their batch firmly are looked up
    when their batch may pay again (here: a gate that measured speculating steps as the faster
    kind): they draft from the context as it is then, and every token stays the ungated engine's."""
    config = DecodeConfig(
        spec=SpeculativeConfig(max_speculative_tokens=4, method="prompt-lookup"),
        async_scheduling=scheduling,
        step_costs=StepCosts((1.0, 1.2, 1.3, 1.4, 1.5)),
    )
    decode = DecodeEngine(pair, config)
    for speculated, seconds in ((True, 100.0), (True, 100.0), (False, 1.0), (False, 1.0)):
        decode.policy.gate.record(2, speculated, seconds)
    prefill = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(method="prompt-lookup")))
    receiver = Receiver.from_contract(pair.contract(), 4)
    batch = [repeated_request(60), repeated_request(60)]
    submitted = []
    for prefilled in prefill.prefill_many([prefill.check(r) for r in batch]):
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        submitted.append(decode.submit(validate_decode_request(wire, receiver)))
    looked = counting_lookups(monkeypatch)
    for _ in range(10):
        decode.step()
    assert not looked and [r.seq.stats.verify_steps for r in submitted] == [0, 0]
    assert all(decode.policy._rows[r.seq].hit is None for r in submitted)
    decode.policy.gate = gate = BatchGate()
    for speculated, seconds in ((True, 1.0), (True, 1.0), (False, 100.0), (False, 100.0)):
        gate.record(2, speculated, seconds)
    while decode.load:
        decode.step()
    assert looked and all(r.seq.stats.verify_steps > 0 and r.seq.stats.prompt_lookup_tokens > 0 for r in submitted)
    emitted = [r.seq.history[len(b.prompt_token_ids) :] for r, b in zip(submitted, batch, strict=True)]
    assert emitted == [out for out, _ in run(pair, batch, scheduling, method="prompt-lookup")]


def hybrid_decode(pair, scheduling: str, gate_steps) -> DecodeEngine:
    """A hybrid decode engine with adaptive K, its gate fed `gate_steps` (speculated, seconds) at batch 4."""
    config = DecodeConfig(
        spec=SpeculativeConfig(max_speculative_tokens=4, method="hybrid"),
        async_scheduling=scheduling,
        step_costs=StepCosts((1.0, 1.2, 1.3, 1.4, 1.5)),
    )
    decode = DecodeEngine(pair, config)
    for speculated, seconds in gate_steps:
        decode.policy.gate.record(4, speculated, seconds)
    return decode


def submit_batch(pair, decode: DecodeEngine, batch) -> list:
    """`batch` through a hybrid prefill engine and the wire, submitted to `decode`."""
    prefill = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(method="hybrid")))
    receiver = Receiver.from_contract(pair.contract(), 4)
    submitted = []
    for prefilled in prefill.prefill_many([prefill.check(r) for r in batch]):
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        submitted.append(decode.submit(validate_decode_request(wire, receiver)))
    return submitted


def finish(pair, decode: DecodeEngine, submitted) -> None:
    for req in submitted:
        decode.cancel(req)
    while decode.load:
        decode.step()
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_rows_the_gate_holds_keep_the_acceptance_they_showed(pair, scheduling):
    """A step the batch gate holds at K = 0 is no observation of its rows: their running
    acceptance does not decay back toward the prior while held, which would make the gate,
    reading their E(K), let a batch whose drafts do not pay speculate again after a few dozen
    steps. A step a row itself chose at K = 0 (no gate) still decays it."""
    decode = hybrid_decode(pair, scheduling, ((True, 1.0), (True, 1.0), (False, 100.0), (False, 100.0)))
    gate = decode.policy.gate  # speculating steps measured the faster kind
    submitted = submit_batch(pair, decode, [request(5 + 2 * i, k=4, max_new=80) for i in range(4)])
    for _ in range(8):
        decode.step()
    rows = [decode.policy._rows[r.seq].adaptive for r in submitted]
    assert all(r.seq.stats.verify_steps > 0 for r in submitted)
    shown = [row.rates("draft") for row in rows]
    assert all(rates[0] != PRIOR for rates in shown)  # what they showed is not the prior
    decode.policy.gate = gate = BatchGate()  # one that has measured K = 0 steps as the faster kind
    for speculated, seconds in ((True, 100.0), (True, 100.0), (False, 1.0), (False, 1.0)):
        gate.record(4, speculated, seconds)
    verify_steps = [r.seq.stats.verify_steps for r in submitted]
    for _ in range(30):  # fewer than the steps between the gate's probes
        decode.step()
    assert [r.seq.stats.verify_steps for r in submitted] == verify_steps  # held at K = 0 throughout
    assert [row.rates("draft") for row in rows] == shown
    decode.policy.gate = None  # ungated, a row's own choice of K = 0 decays its counts toward the prior
    for row in rows:
        row.observe(None, 0, 0)
    assert [row.rates("draft") for row in rows] != shown
    finish(pair, decode, submitted)


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_the_gate_learns_from_each_speculating_step_what_its_rows_emitted(pair, scheduling):
    """Each step the gate let speculate reports to it the tokens its rows expected (the E(K)
    it priced) and the tokens they emitted in that step, which its `realism` follows."""
    decode = hybrid_decode(pair, scheduling, ((True, 1.0), (True, 1.0), (False, 100.0), (False, 100.0)))
    gate, reports = decode.policy.gate, []
    record = gate.record
    gate.record = lambda *args: (reports.append(args), record(*args))
    submitted = submit_batch(pair, decode, [request(5 + 2 * i, k=4, max_new=80) for i in range(4)])
    for _ in range(8):
        before = sum(len(r.seq.history) for r in submitted)
        decode.step()
        rows, speculated, _, _, expected, emitted = reports[-1]
        assert rows == 4 and speculated and expected >= rows
        assert emitted == sum(len(r.seq.history) for r in submitted) - before
    assert gate.realism != 1.0
    finish(pair, decode, submitted)


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_the_gate_prices_newcomers_at_what_the_nodes_rows_showed(pair, scheduling):
    """A row that has shown nothing yet (its first step verifies the prefill node's proposal) is
    priced by the gate at the acceptance the node's rows showed lately, not at the prior: where
    a speculating step costs 1.5 K = 0 steps, a batch of newcomers speculates on a fresh node
    (the prior's E(4) is 1.94 tokens) and is held at K = 0 on one whose proposals were rejected."""
    costs = ((True, 1.5), (True, 1.5), (False, 1.0), (False, 1.0))
    batch = [request(5 + 2 * i, k=4, max_new=40) for i in range(4)]
    fresh = hybrid_decode(pair, scheduling, costs)
    submitted = submit_batch(pair, fresh, batch)
    fresh.step()
    fresh.step()
    assert all(r.seq.stats.verify_steps > 0 for r in submitted)
    finish(pair, fresh, submitted)
    taught = hybrid_decode(pair, scheduling, costs)
    for source in (PREFILL, LOOKUP, DRAFT):
        for _ in range(50):
            taught.policy.shown.count(source, 4, 0)  # every proposal rejected at its first draft
    submitted = submit_batch(pair, taught, batch)
    for _ in range(10):
        taught.step()
    assert [r.seq.stats.verify_steps for r in submitted] == [0] * 4
    finish(pair, taught, submitted)


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_in_a_gated_step_only_the_drafts_that_pay_at_this_batch_size_are_verified(pair, scheduling):
    """Where a drafted token adds 0.1 s to a step of 4 rows and a K = 0 token takes 0.25 s, a
    draft must add a token with a chance of 0.4 to pay: in the step the gate lets speculate, a row
    whose drafts are mostly accepted verifies all 4, and the rows whose first drafts are accepted
    about a third of the time verify none (K = 0 within the speculating step), though at batch 1
    adaptive K would draft for them (a verify of 2 tokens costs 1.2 K = 0 steps there)."""
    decode = hybrid_decode(pair, scheduling, ())
    submitted = submit_batch(pair, decode, [request(5 + 2 * i, k=4, max_new=40) for i in range(4)])
    decode.step()  # the first step: the prefill's proposals
    rows = [decode.policy._rows[r.seq].adaptive for r in submitted]
    for i, row in enumerate(rows):
        for source in (LOOKUP, DRAFT):
            for j in range(20):
                row.count(source, 4, 4 if i == 0 else int(j % 3 == 0))
    decode.policy.gate = gate = BatchGate()
    steps = [(False, 1.0), (False, 1.0)] + [(True, 0.1 * d + 0.1, d) for d in (30, 2, 20, 6, 16, 10, 12, 4, 8, 3)]
    for kind, seconds, *drafted in steps:
        gate.record(4, kind, seconds, *drafted)
    assert gate.floor(4) == pytest.approx(0.4)
    for row in rows[1:]:  # at batch 1 their drafts would pay
        assert row.choose(DRAFT, 4, decode.policy.costs) > 0 and row.rates(DRAFT)[0] < 0.4
    before = [list(r.seq.stats.chosen_k) for r in submitted]
    decode.step()
    after = [r.seq.stats.chosen_k for r in submitted]
    chosen = [[a - b for a, b in zip(now, old, strict=True)] for now, old in zip(after, before, strict=True)]
    assert chosen == [[0, 0, 0, 0, 1]] + [[1, 0, 0, 0, 0]] * 3
    finish(pair, decode, submitted)


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_seeded_sampled_prompt_lookup_draws_the_k0_tokens(pair, scheduling):
    """A seeded sampled request emits the same tokens whatever K prompt lookup drafts (coupling):
    as at K = 0, for a repetitive prompt whose drafts are often accepted and often rejected."""
    prompts = [[*range(3, 12), *range(3, 12)], [*range(3, 9)] * 4, list(range(3, 20))]
    drafted_tokens = accepted = 0
    for seed in range(4):
        batch = []
        for prompt in prompts:
            req = pdspec_pb2.GenerateRequest(prompt_token_ids=prompt, num_speculative_tokens=4)
            req.sampling.do_sample, req.sampling.temperature, req.sampling.seed = True, 0.3, seed
            req.sampling.max_new_tokens = 30
            batch.append(req)
        drafted = run(pair, batch, scheduling, method="prompt-lookup")
        stats = run.stats
        for req in batch:
            req.num_speculative_tokens = 0
        assert drafted == run(pair, batch, scheduling, method="prompt-lookup")
        drafted_tokens += sum(s.prompt_lookup_tokens for s in stats)
        accepted += sum(s.accepted_tokens for s in stats)
    assert drafted_tokens > 20 and 0 < accepted < drafted_tokens  # accepted and rejected drafts both


def test_both_nodes_with_async_scheduling_serve_the_synchronous_streams(pair):
    prompt = list(range(3, 19))

    def generate(client, seed):
        kwargs = {"greedy": True} if seed is None else {"seed": seed}
        return client.generate(prompt_token_ids=prompt, max_new_tokens=18, num_speculative_tokens=0, **kwargs)

    results = {}
    for scheduling in ("off", "on"):
        with cluster(pair, DecodeConfig(async_scheduling=scheduling, max_batch=16)) as (client, _, decode):
            with futures.ThreadPoolExecutor(12) as workers:
                batch = list(workers.map(lambda s: generate(client, s), [None, *range(11)]))
            results[scheduling] = [(g.token_ids, g.finish_reason) for g in batch]
            wait_until(lambda: decode.engine.load == 0, what="engine idle")
            assert decode.engine.pair.target.pool.used_blocks == 0
    assert results["on"] == results["off"] and len({tuple(t) for t, _ in results["on"]}) > 2


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="async_scheduling: expected one of"):
        DecodeConfig(async_scheduling="yes")
    with pytest.raises(ValueError, match="speculate_ahead: expected one of"):
        DecodeConfig(speculate_ahead="yes")
    assert DecodeConfig(device="cuda").pipelined and not DecodeConfig().pipelined


@pytest.mark.parametrize("scheduling", ["off", "on"])
def test_a_failing_step_fails_its_requests_frees_their_blocks_and_the_engine_serves_on(pair, scheduling):
    """A step that raises (here the sampler, on its 4th launch, while a step is in flight) fails
    every request in it and in the step before with an error event; no block stays taken, and
    the next requests decode as if nothing had happened."""
    from sampling import RejectionSampler, Verifier

    real, launches = RejectionSampler("torch", "cpu"), [0]

    def flaky(*args, **kwargs):
        launches[0] += 1
        if launches[0] == 4:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    prefill = PrefillEngine(pair, PrefillConfig())
    config = DecodeConfig(spec=SpeculativeConfig(max_speculative_tokens=4), max_batch=8, async_scheduling=scheduling)
    decode = DecodeEngine(pair, config, verifier=Verifier("torch", "cpu", sampler=flaky, check_values=False))
    receiver = Receiver.from_contract(pair.contract(), 4)

    def submit(requests):
        handles = []
        for prefilled in prefill.prefill_many([prefill.check(r) for r in requests]):
            wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
            handles.append(decode.submit(validate_decode_request(wire, receiver)))
        return handles

    def finish(handles):
        ends = {}
        for _ in range(200):
            decode.step()
            for i, handle in enumerate(handles):
                while not handle.events.empty():
                    event = handle.events.get()
                    if event.finished:
                        ends[i] = event.error or event.finish_reason
            if len(ends) == len(handles) and not decode.load:
                return [ends[i] for i in range(len(handles))]
        raise AssertionError(f"not finished: {ends}")

    ends = finish(submit([request(6 + i, seed=i, max_new=30) for i in range(3)]))
    assert all("decode step failed: injected" in end for end in ends), ends
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0
    assert finish(submit([request(5, max_new=6), request(7, seed=2, max_new=6)])) == ["length", "length"]
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0


def test_calibrate_prices_verifies_against_queued_k0_steps(pair):
    """With async scheduling the start-up table's K = 0 step is a queued one: the table is
    still a sane table, and calibration gives back every KV block it took."""
    engine = DecodeEngine(
        pair,
        DecodeConfig(spec=SpeculativeConfig(method="prompt-lookup", max_speculative_tokens=4), async_scheduling="on"),
    )
    assert engine.pipelined
    costs = engine.calibrate()
    assert len(costs.verify) == 5 and costs.verify[0] == 1.0 and list(costs.verify) == sorted(costs.verify)
    assert pair.target.pool.used_blocks == 0


def test_a_request_being_admitted_counts_against_the_queue_bound(pair):
    """While the engine thread admits a request (out of the queue, not yet stepped) it still
    counts: max_batch 1 + max_queue 1 hold two requests, never three."""
    prefill = PrefillEngine(pair, PrefillConfig())
    decode = DecodeEngine(pair, DecodeConfig(max_batch=1, max_queue=1))
    receiver = Receiver.from_contract(pair.contract(), 4)

    def submit(prompt: int):
        (prefilled,) = prefill.prefill_many([prefill.check(request(prompt, max_new=2))])
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        return decode.submit(validate_decode_request(wire, receiver))

    inside, release, admit = threading.Event(), threading.Event(), decode._admit

    def held(req):  # the engine thread, inside admission
        inside.set()
        release.wait(30)
        admit(req)

    decode._admit = held
    submit(5)
    stepping = threading.Thread(target=decode.step)
    stepping.start()
    try:
        assert inside.wait(30)
        assert decode.load == 1
        submit(6)  # the one queue place
        with pytest.raises(QueueFull):
            submit(7)
    finally:
        release.set()
        stepping.join(30)
    for _ in range(50):
        decode.step()
        if not decode.load:
            break
    assert not decode.load and pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0
