"""Adaptive K (engine/adaptive.py): the cost table, the choice of K from a request's running
acceptance by position, what an observation counts, the decay that makes a request probe
again; StepCosts.measure on a fake clock; DecodeEngine.calibrate on the built-in pair."""

from __future__ import annotations

import random
import types

import pytest

import engine.adaptive as adaptive
from engine.adaptive import DECAY, PRIOR, PRIOR_WEIGHT, AdaptiveK, BatchGate, StepCosts
from engine.spec_config import SpeculativeConfig

LOOKUP, DRAFT = "prompt-lookup", "draft"
CHEAP = StepCosts((1.0,) * 5)  # a verify of any K costs what a K = 0 step does; prompt lookup drafts for free
COSTLY = StepCosts((1, 1.3, 1.5, 1.7, 1.9))


# -- StepCosts -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "verify, depth",
    [((), 0.0), ((1.0, 0.0), 0.0), ((1.0, -1.0), 0.0), ((0.0,), 0.0), ((1.0, 1.2), -0.1)],
)
def test_step_costs_reject_non_positive_costs(verify, depth):
    with pytest.raises(ValueError, match="step costs"):
        StepCosts(verify, depth)


def test_step_costs_of_a_step():
    costs = StepCosts((1.0, 1.5, 2.0), depth=0.25)
    assert costs.of(0, True) == 1.0
    assert costs.of(1, False) == 1.5
    assert costs.of(2, True) == 2.0 + 2 * 0.25
    assert costs.of(5, False) == 2.0  # beyond the table: its last entry
    assert costs.of(5, True) == 2.0 + 5 * 0.25
    assert StepCosts((1.0,)).of(3, True) == 1.0  # depth 0: the draft costs nothing


# -- choose --------------------------------------------------------------------------


def test_no_limit_chooses_zero():
    spec = AdaptiveK(4)
    assert spec.choose(LOOKUP, 0, CHEAP) == 0
    assert spec.choose(DRAFT, 0, CHEAP) == 0


def test_a_fresh_request_drafts_where_drafting_is_cheap():
    assert AdaptiveK(4).choose(LOOKUP, 4, CHEAP) == 4  # every draft adds tokens at no cost
    assert AdaptiveK(4).choose(LOOKUP, 2, CHEAP) == 2
    assert AdaptiveK(4).choose(LOOKUP, 4, COSTLY) > 0  # the prior (a_j = 0.5) still pays for a few


def test_a_costly_draft_model_is_not_used_where_prompt_lookup_still_pays():
    costs = StepCosts((1.0, 1.1, 1.2, 1.3, 1.4), depth=1.0)
    assert AdaptiveK(4).choose(DRAFT, 4, costs) == 0
    assert AdaptiveK(4).choose(LOOKUP, 4, costs) > 0


def test_rejections_at_position_zero_drive_k_to_zero():
    spec = AdaptiveK(4)
    assert spec.choose(LOOKUP, 4, COSTLY) > 0
    for _ in range(30):
        spec.observe(LOOKUP, 4, 0)  # the first draft rejected every step
    assert spec.rates(LOOKUP)[0] < 0.1
    rates = spec.rates(LOOKUP)
    assert rates[1:] == [rates[0]] * 3  # never tested: expected to do as position 0 does
    assert spec.choose(LOOKUP, 4, COSTLY) == 0
    assert spec.choose(LOOKUP, 4, CHEAP) > 0  # free drafts still pay, whatever the odds


def test_full_acceptance_drives_k_to_the_limit():
    spec = AdaptiveK(4)
    for _ in range(30):
        spec.observe(LOOKUP, 4, 4)
    assert all(rate > 0.9 for rate in spec.rates(LOOKUP))
    assert spec.choose(LOOKUP, 4, COSTLY) == 4
    assert spec.choose(LOOKUP, 3, COSTLY) == 3  # the limit (e.g. a shorter match) caps it
    assert spec.choose(LOOKUP, 9, COSTLY) == 4  # and so does the request's K


def test_drafts_after_a_guess_are_priced_with_the_guess_and_admitted_with_it():
    """A row drafting ahead of a guessed token gains from its drafts only where the guess is
    right: the same acceptance that pays for 4 drafts pays for none once the guess's chance
    (`lead`) falls far enough; the batch floor admits fewer of them too."""
    spec = AdaptiveK(4)
    for _ in range(30):
        spec.observe(LOOKUP, 4, 4)
    chosen = [spec.choose(LOOKUP, 4, COSTLY, lead) for lead in (1.0, 0.5, 0.3, 0.2, 0.1, 0.0)]
    assert chosen[0] == 4 and chosen[-1] == chosen[-2] == 0 and chosen == sorted(chosen, reverse=True)
    assert spec.admitted(LOOKUP, 4, 0.5) == 4 and spec.admitted(LOOKUP, 4, 0.5, lead=0.4) == 0


def test_choose_never_exceeds_the_limit_or_the_cap():
    rng = random.Random(3)
    for _ in range(500):
        cap = rng.randint(0, 6)
        spec = AdaptiveK(cap)
        verify = [1.0]
        for _ in range(rng.randint(0, 7)):
            verify.append(verify[-1] + rng.choice([0.0, 0.05, 0.3, 1.0]))
        costs = StepCosts(tuple(verify), rng.choice([0.0, 0.1, 0.5]))
        source = rng.choice([LOOKUP, DRAFT])
        for _ in range(rng.randint(0, 8)):
            depth = rng.randint(0, cap + 2)
            spec.observe(rng.choice([source, None]), depth, rng.randint(0, depth))
        limit = rng.randint(0, 8)
        k = spec.choose(source, limit, costs)
        assert 0 <= k <= min(limit, cap)


# -- observe -------------------------------------------------------------------------


def test_observe_counts_only_the_positions_tested():
    spec = AdaptiveK(4)
    assert spec.rates(LOOKUP) == [PRIOR] * 4
    spec.observe(LOOKUP, 4, 1)  # draft 0 accepted, draft 1 rejected: drafts 2 and 3 never tested
    one = (1 + PRIOR * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT)
    zero = (0 + one * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT)  # each position's prior: the rate before it
    assert spec.rates(LOOKUP) == pytest.approx([one, zero, zero, zero])


def test_decayed_counts_equal_counts_decayed_one_by_one_across_a_rescale():
    """A decay scales the stored counts at once (`RESCALE`): over thousands of steps, past many
    rescales, the rates are those of counts decayed one by one, as a row's history reads."""
    rng = random.Random(3)
    spec, cap = AdaptiveK(4), 4
    counts = {source: ([0.0] * cap, [0.0] * cap) for source in (LOOKUP, DRAFT)}
    for _ in range(3000):
        source, depth = rng.choice((LOOKUP, DRAFT, None)), rng.randrange(cap + 2)
        accepted = rng.randrange(depth + 1)
        spec.observe(source, depth, accepted)
        for acc, tested in counts.values():
            acc[:] = [a * DECAY for a in acc]
            tested[:] = [t * DECAY for t in tested]
        if source is not None:
            acc, tested = counts[source]
            for j in range(min(depth, accepted + 1, cap)):
                tested[j] += 1.0
                acc[j] += 1.0 if j < accepted else 0.0
    for source, (acc, tested) in counts.items():
        expected, rate = [], PRIOR
        for a, t in zip(acc, tested, strict=True):
            rate = (a + rate * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)
            expected.append(rate)
        assert spec.rates(source) == pytest.approx(expected, rel=1e-9)  # float64 sums of O(10) terms


def test_observe_all_accepted_tests_the_drafted_positions_only():
    spec = AdaptiveK(4)
    spec.observe(LOOKUP, 2, 2)  # both drafts accepted: positions 0 and 1, nothing deeper
    one = (1 + PRIOR * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT)
    two = (1 + one * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT)
    assert spec.rates(LOOKUP) == pytest.approx([one, two, two, two])
    spec.observe(LOOKUP, 7, 7)  # deeper than the cap: only the cap's positions are counted
    assert len(spec.rates(LOOKUP)) == 4


def test_sources_are_counted_apart_and_decay_together():
    spec = AdaptiveK(2)
    spec.observe(DRAFT, 2, 0)
    spec.observe(LOOKUP, 2, 2)  # decays the draft's counts as well
    rejected = (0 + PRIOR * PRIOR_WEIGHT) / (DECAY + PRIOR_WEIGHT)
    accepted = (1 + PRIOR * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT)
    assert spec.rates(DRAFT) == pytest.approx([rejected, rejected])
    assert spec.rates(LOOKUP) == pytest.approx([accepted, (1 + accepted * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT)])


def test_decay_makes_a_request_at_zero_probe_again():
    spec = AdaptiveK(4)
    for _ in range(30):
        spec.observe(LOOKUP, 4, 0)
    assert spec.choose(LOOKUP, 4, COSTLY) == 0
    steps = 0
    while spec.choose(LOOKUP, 4, COSTLY) == 0:
        spec.observe(None, 0, 0)  # a K = 0 step: nothing drafted, the counts decay
        steps += 1
        assert steps < 100, "never probes again"
    assert steps > 1  # not at once: the rejections are remembered for a while
    assert spec.rates(LOOKUP)[0] > 0.25


def test_a_prior_of_rates_stands_where_a_request_has_shown_little():
    """Given another's rates (the node's), a position the request has not tested is expected to do
    as they say, not as PRIOR; what the request shows outweighs them as it accumulates."""
    spec, low = AdaptiveK(3), [0.1, 0.05, 0.02]
    assert spec.rates(LOOKUP) == pytest.approx([PRIOR] * 3)
    assert spec.rates(LOOKUP, low) == pytest.approx(low)
    assert spec.expected(LOOKUP, 2, low) == pytest.approx(1 + 0.1 + 0.1 * 0.05)
    for _ in range(30):
        spec.observe(LOOKUP, 3, 3)
    assert all(a > 0.8 for a in spec.rates(LOOKUP, low))


def test_decay_and_count_make_an_observation():
    a, b = AdaptiveK(3), AdaptiveK(3)
    for accepted in (0, 2, 3, 1):
        a.observe(DRAFT, 3, accepted)
        b.decay(DECAY)
        b.count(DRAFT, 3, accepted)
    assert a.rates(DRAFT) == b.rates(DRAFT)
    b.count(None, 3, 3)  # nothing proposed: nothing counted
    b.count(DRAFT, 0, 0)
    assert a.rates(DRAFT) == b.rates(DRAFT)


def test_answers_follow_counts_added_without_a_decay():
    """Rates, K and the wait are kept until the counts change (a row the batch gate holds asks
    the same every step); `count` alone changes them too (the node's shown acceptance)."""
    costs = StepCosts((1.0, 1.2, 1.3, 1.4, 1.5), sync=1.6)
    row = AdaptiveK(4)
    for _ in range(20):
        row.count(LOOKUP, 4, 0)
    asked = row.rates(LOOKUP)[0], row.choose(LOOKUP, 4, costs), row.pays_to_wait(LOOKUP, 1, costs)
    assert asked == (row.rates(LOOKUP)[0], row.choose(LOOKUP, 4, costs), row.pays_to_wait(LOOKUP, 1, costs))
    assert asked[1] == 0 and not asked[2]
    for _ in range(40):
        row.count(LOOKUP, 4, 4)
    assert row.rates(LOOKUP)[0] > asked[0]
    assert row.choose(LOOKUP, 4, costs) == 4
    assert row.pays_to_wait(LOOKUP, 1, costs)


def test_a_held_row_keeps_one_answer_per_source_as_the_node_rates_move():
    """A row the batch gate holds keeps its counts while the node's rates (the prior its gain is
    priced at) move every step: its kept answers stay as many as its questions, not its steps,
    and each answer is the one for the prior asked."""
    row = AdaptiveK(4)
    for _ in range(5):
        row.count(LOOKUP, 4, 2)
    for step in range(200):
        prior = [0.5 + step * 1e-3] * 4
        fresh = AdaptiveK(4)
        for _ in range(5):
            fresh.count(LOOKUP, 4, 2)
        assert row.rates(LOOKUP, prior) == fresh.rates(LOOKUP, prior)
        row.rates(LOOKUP)
    assert len(row._known) <= 2


def test_a_simulated_request_settles_and_recovers():
    """Acceptance driven by choose: a request whose lookups stop paying falls to K = 0, then
    after its text turns repetitive again reaches the full K."""
    spec = AdaptiveK(4)
    costs = StepCosts((1.0, 1.1, 1.2, 1.3, 1.4))
    chosen = []
    for step in range(120):
        k = spec.choose(LOOKUP, 4, costs)
        chosen.append(k)
        if not k:
            spec.observe(None, 0, 0)
        else:
            spec.observe(LOOKUP, k, 0 if step < 60 else k)  # everything rejected, then everything accepted
    assert 0 in chosen[:60] and chosen[110:] == [4] * 10


# -- StepCosts.measure ----------------------------------------------------------------


class FakeClock:
    """perf_counter() that moves only when the fake work says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_measure_on_a_fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(adaptive, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    calls = {"verify": [], "draft": 0}
    noise = iter([0.3, 0.0, 0.2, 0.1, 0.4] * 20)

    def verify_step(k: int) -> None:
        calls["verify"].append(k)
        first = calls["verify"].count(k) == 1
        clock.now += 100.0 if first else 2.0 + 0.5 * k + next(noise)  # the warm-up is slow, then best of 5

    def draft_depth() -> None:
        calls["draft"] += 1
        clock.now += 1.0 + next(noise)

    costs = StepCosts.measure(verify_step, draft_depth, 4)
    assert calls["verify"] == [k for k in range(5) for _ in range(6)] and calls["draft"] == 6
    assert costs.verify[0] == 1.0
    assert costs.verify == pytest.approx((1.0, 1.25, 1.5, 1.75, 2.0))
    assert costs.depth == pytest.approx(0.5)


def test_measure_never_lets_noise_make_k_cheaper(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(adaptive, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    per_k = {0: 2.0, 1: 1.5, 2: 3.0, 3: 2.5, 4: 4.0}  # k = 1 "faster" than k = 0, k = 3 than k = 2

    def verify_step(k: int) -> None:
        clock.now += per_k[k]

    costs = StepCosts.measure(verify_step, None, 4)
    assert costs.verify == pytest.approx((1.0, 1.0, 1.5, 1.5, 2.0))
    assert list(costs.verify) == sorted(costs.verify)  # non-decreasing
    assert costs.depth == 0.0  # no draft model (prompt lookup)


def test_measure_against_queued_k0_steps(monkeypatch):
    """With async scheduling a K = 0 step is queued behind the one before: its cost is a share
    of QUEUED steps read once, cheaper than one read back, and every verify is priced against it;
    a verify queued ahead (`ahead`) is priced as such a share too."""
    clock = FakeClock()
    monkeypatch.setattr(adaptive, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    per_k = {0: 2.0, 1: 2.2, 2: 2.4}
    queued = []

    def verify_step(k: int) -> None:
        clock.now += per_k[k]

    def queued_steps(n: int, k: int) -> None:
        queued.append((n, k))
        clock.now += (1.0 + 0.05 * k) * n + 0.8  # 1.0 per queued K = 0 step and 0.05 per draft, plus one read

    costs = StepCosts.measure(verify_step, lambda: setattr(clock, "now", clock.now + 0.5), 2, queued_steps)
    assert set(queued) == {(adaptive.QUEUED, k) for k in range(3)}
    base = 1.0 + 0.8 / adaptive.QUEUED
    assert costs.verify == pytest.approx((1.0, 2.2 / base, 2.4 / base))
    assert costs.ahead == pytest.approx((1.0, (1.05 + 0.1) / base, (1.1 + 0.1) / base))
    assert costs.drafting_ahead().verify == costs.ahead and costs.drafting_ahead().sync == 1.0
    assert costs.depth == pytest.approx(0.5 / base)
    assert costs.sync == pytest.approx(2.0 / base)  # a K = 0 step read back
    plain = StepCosts.measure(verify_step, None, 2)
    assert plain.sync == 1.0 and plain.ahead == ()  # no async scheduling: every step is read back
    assert plain.drafting_ahead().verify == plain.verify


def test_measure_with_busy_work():
    """Real timing of deterministic work proportional to k: verify[0] is 1 and nothing decreases."""

    def verify_step(k: int) -> None:
        sum(i * i for i in range(2000 * (k + 1)))

    costs = StepCosts.measure(verify_step, lambda: sum(range(500)), 3)
    assert len(costs.verify) == 4 and costs.verify[0] == 1.0
    assert all(c >= 1.0 for c in costs.verify)
    assert list(costs.verify) == sorted(costs.verify)  # non-decreasing
    assert costs.depth > 0


# -- DecodeEngine.calibrate ------------------------------------------------------------


@pytest.mark.parametrize("method", ["prompt-lookup", "hybrid"])
def test_calibrate_measures_a_table_on_the_models(pair, method):
    from decode_node.engine import DecodeConfig, DecodeEngine

    engine = DecodeEngine(pair, DecodeConfig(spec=SpeculativeConfig(method=method, max_speculative_tokens=4)))
    costs = engine.calibrate()
    assert engine.policy.costs is costs
    assert len(costs.verify) == 5 and costs.verify[0] == 1.0
    assert list(costs.verify) == sorted(costs.verify)  # non-decreasing
    assert (costs.depth > 0) == (method == "hybrid")  # prompt lookup alone drafts for free


def test_calibrate_keeps_a_configured_table_and_skips_without_adaptive_k(pair):
    from decode_node.engine import DecodeConfig, DecodeEngine

    configured = DecodeEngine(pair, DecodeConfig(spec=SpeculativeConfig(method="prompt-lookup"), step_costs=COSTLY))
    assert configured.calibrate() is COSTLY
    default = DecodeEngine(pair, DecodeConfig(spec=SpeculativeConfig(method="prompt-lookup", adaptive_k="off")))
    assert default.calibrate().verify == (1.0,) * 9  # max_speculative_tokens 8: untouched
    assert not SpeculativeConfig().adaptive  # the draft model: auto is off
    assert SpeculativeConfig(adaptive_k="on").adaptive
    assert SpeculativeConfig(method="hybrid").adaptive
    assert not SpeculativeConfig(method="hybrid", adaptive_k="off").adaptive
    with pytest.raises(ValueError, match="adaptive_k"):
        DecodeConfig(spec=SpeculativeConfig(adaptive_k="maybe"))


# -- BatchGate ---------------------------------------------------------------------------


def test_batch_buckets_are_powers_of_two():
    assert [BatchGate.bucket(b) for b in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


def steps(gate: BatchGate, batch: int, speculated: bool, seconds: float, n: int = 2) -> None:
    for _ in range(n):
        gate.record(batch, speculated, seconds)


def test_expected_tokens_of_a_verify():
    spec = AdaptiveK(3)
    assert spec.expected(LOOKUP, 0) == 1.0
    a = spec.rates(LOOKUP)
    assert spec.expected(LOOKUP, 2) == pytest.approx(1 + a[0] + a[0] * a[1])


def test_the_gate_times_speculating_then_plain_steps_before_it_holds():
    gate = BatchGate()
    assert gate.allows(16, 16.0)  # nothing timed: speculate (and time it)
    steps(gate, 16, True, 2.0)
    assert gate.time(16, True) == 2.0 and not gate.allows(16, 40.0)  # then a K = 0 step, to time it
    steps(gate, 16, False, 1.0)
    assert gate.time(16, False) == 1.0
    assert not gate.allows(16, 24.0)  # 24 tokens in 2 s against 16 in 1 s: hold at K = 0
    assert gate.allows(16, 40.0)  # 40 in 2 s: speculate
    # A bucket not timed yet borrows the nearest timed one's ratio: no new timing as a batch shrinks.
    assert not gate.allows(2, 3.0) and gate.allows(2, 4.0)
    steps(gate, 2, False, 0.1)
    assert gate.time(2, True) is None and not gate.allows(2, 3.0) and gate.allows(2, 4.0)  # 0.2 s at this ratio


def test_whether_speculating_pays_is_asked_without_moving_the_probes():
    """`pays` answers what `allows` decides between probes (None until both kinds are timed)
    and leaves the probe schedule where it was: asking it any number of times between two steps
    changes no verdict of the gate."""
    gate, twin = BatchGate(), BatchGate()
    assert gate.pays(16, 40.0) is None
    for g in (gate, twin):
        steps(g, 16, True, 2.0)
        steps(g, 16, False, 1.0)
    verdicts = []
    for _ in range(3 * BatchGate.PROBE_EVERY):
        assert gate.pays(16, 24.0) is False and gate.pays(16, 40.0) is True
        verdicts.append(gate.allows(16, 24.0))
        assert verdicts[-1] == twin.allows(16, 24.0)
    assert any(verdicts) and not all(verdicts)  # held, but probed now and then


def test_the_gate_prices_the_rows_forecast_at_what_speculating_steps_emitted():
    """Speculating steps whose rows emit half the tokens they expected halve the price of the
    next forecast (within REALISM_RANGE): 24 tokens forecast in 2 s beat 16 in 1 s until the
    outcomes show that forecast runs high; outcomes above the forecast raise it again."""
    gate = BatchGate()
    steps(gate, 16, True, 2.0)
    steps(gate, 16, False, 1.0)
    assert gate.allows(16, 40.0)
    for _ in range(60):  # timed steps and their outcomes: 20 tokens emitted of 40 expected
        gate.record(16, True, 2.0, expected=40.0, emitted=20)
    assert gate.realism == pytest.approx(0.5, abs=1e-2) and gate.time(16, True) == 2.0
    assert not gate.allows(16, 40.0) and gate.allows(16, 66.0)
    for _ in range(60):
        gate.record(16, True, 2.0, expected=20.0, emitted=100)  # 5x: clamped to the range's top
    assert gate.realism == pytest.approx(BatchGate.REALISM_RANGE[1], abs=1e-2)
    assert gate.allows(16, 22.0)
    gate.record(16, False, 1.0, expected=10.0, emitted=0)  # a K = 0 step says nothing of a forecast
    assert gate.realism == pytest.approx(BatchGate.REALISM_RANGE[1], abs=1e-2)


def test_a_step_after_one_of_the_other_kind_is_not_timed():
    gate = BatchGate()
    gate.record(4, False, 1.0)  # the first of its kind: not timed
    assert gate.time(4, False) is None
    gate.record(4, False, 3.0)
    assert gate.time(4, False) == 3.0
    gate.record(4, True, 100.0)
    assert gate.time(4, True) is None
    gate.record(4, True, 5.0)
    gate.record(4, True, 1.0)
    assert gate.time(4, True) == pytest.approx(5.0 + BatchGate.SMOOTHING * (1.0 - 5.0))


def test_the_slower_kind_is_probed_at_a_bounded_cost_and_the_times_follow_it():
    gate = BatchGate()
    steps(gate, 8, True, 10.0)  # a speculating step costs ten K = 0 steps
    steps(gate, 8, False, 1.0)
    every = BatchGate.PROBE_STEPS * 10.0 / BatchGate.PROBE_SHARE  # probing takes PROBE_SHARE of the time
    assert every > BatchGate.PROBE_EVERY
    choices = [gate.allows(8, 12.0) for _ in range(2 * int(every + BatchGate.PROBE_STEPS))]
    assert choices.count(True) == 2 * BatchGate.PROBE_STEPS  # probes only
    first = choices.index(True)
    assert first == every and all(choices[first : first + BatchGate.PROBE_STEPS])
    steps(gate, 8, True, 1.2, n=30)  # speculating steps got cheaper: 12 tokens in 1.2 s beat 8 in 1 s
    assert gate.allows(8, 12.0)
    plain_probes = [not gate.allows(8, 12.0) for _ in range(2 * (BatchGate.PROBE_EVERY + BatchGate.PROBE_STEPS))]
    assert plain_probes.count(True) == 2 * BatchGate.PROBE_STEPS  # the slower K = 0 is probed every PROBE_EVERY


def test_the_floor_is_a_drafted_tokens_seconds_over_a_k0_tokens():
    """Speculating steps of 8 rows cost 0.5 s + 0.1 s per drafted token; a K = 0 step 1 s, so a
    token takes 1/8 s at K = 0 and a draft pays only if it adds a token with a chance of at
    least 0.1 / (1/8) = 0.8. Until enough steps with different drafts are fitted: 0."""
    gate = BatchGate()
    assert gate.floor(8) == 0.0
    steps(gate, 8, False, 1.0)
    drafted = [4, 12, 8, 20, 16, 6, 10, 14, 18, 2] * 3
    for d in drafted[: BatchGate.FIT_STEPS - 1]:
        gate.record(8, True, 0.5 + 0.1 * d, d)
    assert gate.floor(8) == 0.0  # the first speculating step after K = 0 ones is not timed: too few
    for d in drafted:
        gate.record(8, True, 0.5 + 0.1 * d, d)
    assert gate.floor(8) == pytest.approx(0.8)
    assert gate.floor(3) == 0.0  # another bucket: nothing fitted there
    same = BatchGate()  # every step drafted as many: no slope to tell
    steps(same, 8, False, 1.0)
    for _ in range(20):
        same.record(8, True, 2.0, 10)
    assert same.floor(8) == 0.0


def test_admitted_drafts_are_those_likely_enough_to_add_a_token():
    spec = AdaptiveK(4)
    rates = [0.9, 0.8, 0.5, 0.5]  # reach 0.9, 0.72, 0.36, 0.18
    assert [spec.admitted(DRAFT, 4, floor, rates) for floor in (0.0, 0.2, 0.5, 0.8, 0.95)] == [4, 3, 2, 1, 0]
    assert spec.admitted(DRAFT, 2, 0.0, rates) == 2  # never more than asked


# -- waiting for the token in flight (async scheduling) ---------------------------------------


def spec_with(rate: float, steps: int = 40) -> AdaptiveK:
    """A request whose prompt-lookup drafts were accepted at `rate` per position, steady."""
    spec = AdaptiveK(4)
    rng = random.Random(3)
    for _ in range(steps):
        accepted = 0
        while accepted < 4 and rng.random() < rate:
            accepted += 1
        spec.observe("lookup", 4, accepted)
    return spec


def test_waiting_pays_only_when_the_match_is_likely_to_hold():
    """E(k) - cost(k) tokens gained if the token in flight continues the match (chance a_0),
    (sync - 1) lost otherwise: a row whose drafts are mostly accepted waits, one whose drafts
    are rejected as often as not does not, though both would draft once there (choose > 0)."""
    costs = StepCosts((1.0, 1.2, 1.3, 1.4, 1.5), sync=1.6)
    strong, weak = spec_with(0.9), spec_with(0.55)
    for spec in (strong, weak):
        assert spec.choose("lookup", 4, costs) > 0
    assert strong.pays_to_wait("lookup", strong.choose("lookup", 4, costs), costs)
    k = weak.choose("lookup", 4, costs)
    a = weak.rates("lookup")[0]
    assert a * (weak.expected("lookup", k) - costs.of(k, False)) < (1 - a) * 0.6  # the rule, by hand
    assert not weak.pays_to_wait("lookup", k, costs)
    # Without async scheduling (sync = 1) nothing is lost by waiting: any K worth drafting is worth it.
    flat = StepCosts(costs.verify)
    assert weak.pays_to_wait("lookup", weak.choose("lookup", 4, flat), flat)


def test_sync_below_one_is_refused():
    with pytest.raises(ValueError, match="sync >= 1"):
        StepCosts((1.0, 1.2), sync=0.9)
