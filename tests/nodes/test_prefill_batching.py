"""Concurrent prefills run batched: one target forward for several prompts, chunked when
they exceed --max-prefill-tokens, with every request's first token, drafts and KV exactly
what it gets alone (same seed)."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from engine.paged_lm import bytes_per_token, paged_pair
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from sampling.proposal import DraftLaw
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("prefill-batching"), "llama", seed=4, layers=2)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    raw = load_pair(target_model=path, draft_layers=1)
    return paged_pair(raw, 2048 * (bytes_per_token(raw.target) + bytes_per_token(raw.draft)))


def request(i: int, length: int) -> pdspec_pb2.GenerateRequest:
    return pdspec_pb2.GenerateRequest(
        request_id=f"r{i}",
        prompt_token_ids=[(7 * i + j) % 80 + 2 for j in range(length)],
        num_speculative_tokens=3,
        sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=i, max_new_tokens=8),
    )


def summary(prefilled) -> tuple:
    header = prefilled.wire.header
    kv = torch.cat([t.float().flatten() for t in prefilled.kv])
    return prefilled.first_token, list(header.proposal.token_ids), kv


LENGTHS = [5, 40, 17, 90, 3, 33]


def solo_runs(pair) -> list[tuple]:
    """What each of the LENGTHS requests gets alone (one engine, one request at a time)."""
    engine = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(draft_law=DraftLaw.STOCHASTIC)))
    return [summary(engine.prefill(engine.check(request(i, n)))) for i, n in enumerate(LENGTHS)]


def counted(engine: PrefillEngine) -> list[int]:
    """The jobs queued at each of `engine`'s steps, appended as the steps run."""
    steps, original = [], engine._step

    def counting_step():
        steps.append(len(engine._jobs))
        original()

    engine._step = counting_step
    return steps


def assert_same(results, solo) -> None:
    for got, want in zip(results, solo, strict=True):
        assert got[0] == want[0] and got[1] == want[1]
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_concurrent_and_chunked_prefills_equal_solo_runs(pair):
    lengths = LENGTHS
    solo = solo_runs(pair)
    batched_engine = PrefillEngine(
        pair, PrefillConfig(spec=SpeculativeConfig(draft_law=DraftLaw.STOCHASTIC), max_prefill_tokens=32)
    )
    steps = counted(batched_engine)
    results = [None] * len(lengths)
    barrier = threading.Barrier(len(lengths))

    def run(i: int) -> None:
        checked = batched_engine.check(request(i, lengths[i]))
        barrier.wait()
        results[i] = summary(batched_engine.prefill(checked))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lengths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_same(results, solo)
    assert max(steps) > 1  # some step saw several queued requests
    assert len(steps) >= sum(lengths) // 32  # the 32-token budget chunked the prompts
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0


def test_prefill_many_equals_solo_runs_in_order(pair):
    """One caller's list of requests: batched into shared steps (as the statistical harness
    uses it), each result what the request gets alone, in the list's order."""
    solo = solo_runs(pair)
    engine = PrefillEngine(
        pair, PrefillConfig(spec=SpeculativeConfig(draft_law=DraftLaw.STOCHASTIC), max_prefill_tokens=64)
    )
    steps = counted(engine)
    batched = engine.prefill_many([engine.check(request(i, n)) for i, n in enumerate(LENGTHS)])
    assert_same([summary(p) for p in batched], solo)
    assert steps[0] == len(LENGTHS) and len(steps) < len(LENGTHS)  # shared steps, not one per request
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0


def test_a_prompt_larger_than_the_kv_cache_is_resource_exhausted(pair):
    from protos.validation import Code

    engine = PrefillEngine(pair, PrefillConfig())
    found = engine.check(request(0, pair.target.capacity_tokens() + 1))
    assert [v.code for v in found] == [Code.RESOURCE_EXHAUSTED] and "KV cache" in found[0].expected


def test_first_tokens_come_before_the_proposals_and_exports(pair):
    """A step draws the first tokens of the prompts it completes and hands them out; the
    proposals and KV exports are the next step's work, batched, and equal a solo run's."""
    solo = solo_runs(pair)[:2]
    engine = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(draft_law=DraftLaw.STOCHASTIC)))
    steps = counted(engine)
    tickets = [engine.submit(engine.check(request(i, n))) for i, n in enumerate(LENGTHS[:2])]
    first = tickets[0].first()
    assert steps == [2]  # one step: both prompts in one forward, nothing proposed or exported yet
    assert all(t.job.first.is_set() and not t.job.done.is_set() for t in tickets)
    assert first.token == solo[0][0] and first.finish_reason == ""
    results = [t.result() for t in tickets]
    assert steps == [2, 2]  # the next step proposed and exported both
    assert_same([summary(r) for r in results], solo)
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0


def test_an_abandoned_request_gives_its_kv_back(pair):
    """A caller that leaves after its first token (the client cancelled): the request ends
    without a result, its KV back in the pool, and the engine serves the next one."""
    engine = PrefillEngine(pair, PrefillConfig())
    ticket = engine.submit(engine.check(request(0, 40)))
    ticket.first()
    assert pair.target.pool.used_blocks > 0
    ticket.abandon()
    assert ticket.job.done.is_set() and ticket.job.result is None and not engine._jobs
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0
    assert summary(engine.prefill(engine.check(request(1, 40))))[0] == solo_runs(pair)[1][0]
