"""The decode scheduler's speculation policy: per step, which rows draft and how deep, whether
the step can be queued before the one in flight is read (async scheduling), and whether the
batch gate holds it at K = 0. The scheduler (decode_node/engine.py) asks once per step and
executes the answer; it names no drafting method.

Per row (`_Row`): its adaptive-K state (engine/adaptive.py: running acceptance per source and
position, and the K whose expected tokens per unit of cost are highest), and, for a proposer
that drafts only where the context matches (prompt lookup, `Proposer.match_driven`), whether
the context had a match worth drafting after its last step (`hit`) and after the one before
(`may_draft`). Step t may draft only if it had one after step t - 2: that is known before step
t - 1 is read, so rows without a match pipeline like K = 0 rows.

The batch gate (engine/adaptive.BatchGate) prices speculation for the batch as a whole, for
every method: from the wall times of the steps this node actually ran at this batch size, a step
speculates only while the tokens its rows expect (their own E(K)) per second beat a K = 0 step's
(a step it holds leaves the rows' acceptance as they showed it, undecayed); so a method whose
drafting does not pay at the current load (a draft model at batch 16, say) is not run for that
step, and a batch whose rows find nothing to draft pipelines like K = 0. Where even the rows'
best (each offered all its K drafts) would not pay, the batch is held without looking up what
their contexts offer (`_best`, `_look_up`): a held batch of prompt-lookup rows then costs what a
K = 0 batch costs.

None of this changes the output law: K depends only on the past (the rows' own acceptance and
the node's measured step times), never on the step's uniforms. A seeded sampled row's tokens
depend on K unless its proposals are point masses verified by coupling (sampling/verifier.py:
prompt lookup); so the gate holds a batch only when every row's tokens are free of it (greedy
rows, unseeded rows, point-mass proposals), and a seeded request draws the same tokens whatever
else runs beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from engine.adaptive import DECAY, PRIOR_WEIGHT, AdaptiveK, BatchGate, StepCosts, calibrate
from engine.proposer import Plan, Proposer
from engine.sequence import Sequence
from engine.spec_config import SpeculativeConfig
from models.base import CausalLM
from sampling import Verifier
from sampling.proposal import LOOKUP, PREFILL

log = logging.getLogger(__name__)

SHOWN_DECAY = 0.98  # per step, of what the node's rows showed: back toward PRIOR after a few hundred steps
GUESS_DECAY = DECAY  # per guess, of a row's guesses before it: as recent as its acceptance


@dataclass
class _Row:
    adaptive: AdaptiveK | None  # None: the row drafts its own K every step
    # A match worth drafting after the last step (match-driven proposers); None: not looked up,
    # since the batch gate held the batch even at its rows' best (`SpecPolicy.hold`).
    hit: bool | None = True
    may_draft: bool | None = True  # the same after the step before
    planned: tuple[str, int] = ("", 0)  # the source and K adaptive K chose when the context last grew
    gated: bool = False  # the batch gate held the row's latest step at K = 0
    guesses: tuple[float, float] = (0.0, 0.0)  # drafting ahead: (right, made) guesses of the token in flight


@dataclass(frozen=True)
class StepChoice:
    """What one synchronous step drafts: row r's plan (None: it drafts nothing of its own, e.g.
    it verifies what it received) and depth (0: none)."""

    plans: list[Plan | None]
    depths: list[int]


class SpecPolicy:
    def __init__(
        self, spec: SpeculativeConfig, proposer: Proposer, costs: StepCosts, pipelined: bool, ahead: bool = False
    ) -> None:
        self.spec, self.proposer = spec, proposer
        self.costs = costs  # adaptive K's cost table (engine/adaptive.calibrate at start-up)
        self.pipelined = pipelined  # async scheduling is on
        self.drafting_ahead = ahead  # prompt-lookup rows may speculate in queued steps (`ahead`)
        # Whether a batch speculates at all, from its measured steps (adaptive K: it prices each row).
        self.gate = BatchGate() if spec.adaptive else None
        # What this node's rows showed lately, all together: the gate prices a row that has shown
        # little (a newcomer, one held for long) at that, not at the optimistic PRIOR.
        self.shown = AdaptiveK(spec.max_speculative_tokens)
        self._rows: dict[Sequence, _Row] = {}
        self._gated: tuple[int, bool] | None = None  # (rows, speculated) of this step, when the gate chose it
        self._floor = 0.0  # BatchGate.floor of this step's batch: the drafts a gated step verifies
        self._firm = False  # this step held even at its rows' best: the contexts that grow are not looked up
        self._drafted = 0  # drafts this step verifies, for the gate's fit
        self._expected = 0.0  # tokens this step's rows expect from it, where the gate let it speculate
        self._emitted = 0  # tokens this step's rows emitted, for the gate's `realism`
        # The cost table was measured here (not configured): then a single row's steps are gated
        # too, since what a step costs as the node runs it (its host work, the read-back a
        # speculating step waits for) is what the start-up table leaves out.
        self._measured = False

    # -- rows ---------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """A row joins the batch; one that was preempted and comes back keeps what it had shown."""
        if seq not in self._rows:
            self._rows[seq] = _Row(AdaptiveK(seq.k) if self.spec.adaptive and seq.k else None)

    def forget(self, seq: Sequence) -> None:
        self._rows.pop(seq, None)

    # -- one step -------------------------------------------------------------------------
    def hold(self, seqs: list[Sequence], unread: Collection[Sequence]) -> bool:
        """Whether this step runs at K = 0 (queued, with async scheduling): when every row emits
        one token anyway (`pipelines`), or when the batch gate holds it there. `unread`: the rows
        of the step in flight. A batch with nothing to read back but its tokens is gated (a
        single row only where the cost table was measured on this node: a configured table is
        the whole policy); its step is then timed for the gate (`timed`), of either kind. A
        row on its first step is held by dropping the prefill's proposal (a point mass too):
        else every request that joins a large batch would make one step of the whole batch
        speculate."""
        self._gated = None
        self.shown.decay(SHOWN_DECAY)
        # a batch that drafts ahead is queued whatever its rows' matches: only the gate holds it
        pipelines = self.pipelines(seqs, unread) and not self.ahead(seqs)
        gateable = (
            self.gate is not None
            and (len(seqs) > 1 or self._measured)
            and all(
                not s.logprobs
                and s.grammar is None  # its mask comes with every step: never queued
                and (s.plain or (self._rows[s].adaptive is not None and self._batch_free(s)))
                for s in seqs
            )
        )
        held = firm = False
        self._floor, self._drafted, self._expected, self._emitted = 0.0, 0, 0.0, 0
        if gateable:
            self._floor = self.gate.floor(len(seqs))
            # a step that pipelines emits a token a row whatever the gate says: no gain to price
            if not pipelines:
                # Where even the rows' best (each offered all its K) does not pay, the step is
                # held without looking up what they offer: the gate's probes come as they would
                # at the real gains, which do not pay either.
                bounds = [self._best(s, s in unread) for s in seqs]
                best = sum(bound for bound, _ in bounds)
                firm = self.gate.pays(len(seqs), best) is False
                if firm:
                    held = not self.gate.allows(len(seqs), 0.0)
                if not held:  # priced at what the rows offer (a probe speculates whatever they offer)
                    if not all(gain for _, gain in bounds):  # some row's best was not its gain
                        self._look_up(seqs)
                        pipelines = self.pipelines(seqs, unread) and not self.ahead(seqs)
                        best = 0.0 if pipelines else sum(self._gain(s, s in unread) for s in seqs)
                    if not pipelines:
                        self._expected = best
                        held = not firm and not self.gate.allows(len(seqs), best)
            self._gated = (len(seqs), not (pipelines or held))
        self._firm = firm and held
        for seq in seqs:
            self._rows[seq].gated = held
        return pipelines or held

    def pipelines(self, seqs: list[Sequence], unread: Collection[Sequence]) -> bool:
        """Whether this step can be queued before the step in flight (its rows: `unread`) is
        read: every row emits exactly one token (no drafts: K = 0, or a match-driven row that may
        not draft now) and needs nothing but its token back (no logprobs)."""
        if not self.pipelined:
            return False
        return all(s.plain or self._idle(s, s in unread) for s in seqs)

    def ahead(self, seqs: list[Sequence]) -> bool:
        """Whether a step that speculates can be queued before the step in flight is read, its rows
        drafting ahead (decode_node/engine.py `_ahead`): with async scheduling, for a proposer
        that drafts point-mass chains from the context alone (prompt lookup), where every row
        needs nothing but its tokens back (a sampled row is verified by coupling at positions
        the device moves back with its KV), and some row may draft (a batch of K = 0 rows is
        a plain queued step: no matching, no gate); never with `--speculate-ahead off`."""
        drafting = [self._drafts_ahead(s) for s in seqs]
        return any(drafting) and all(s.plain or d for s, d in zip(seqs, drafting, strict=True))

    def ahead_depths(self, seqs: list[Sequence], limits: list[int], guessing: list[bool]) -> list[int]:
        """Each row's K in a step drafting ahead, of the `limits[r]` drafts its match offers: what
        adaptive K pays for (admitted by the step's floor where the gate let it speculate), or
        all of them. A row `guessing` the token its step in flight emits drafts after that
        guess: each draft's chance carries the row's rate of right guesses (`guessed`)."""
        depths, ahead = [], self.costs.drafting_ahead()
        for seq, limit, guess in zip(seqs, limits, guessing, strict=True):
            row = self._rows[seq]
            if row.adaptive is None or not limit:
                depths.append(limit)
                continue
            lead = self._guess_rate(row) if guess else 1.0
            depths.append(self._depth(row.adaptive, LOOKUP, limit, ahead, lead))
        self._drafted = sum(depths)
        return depths

    def guessed(self, seq: Sequence, right: bool) -> None:
        """Whether a row drafting ahead guessed the token its step in flight emitted, and that
        step's accepted count (what its drafts after the guess assumed)."""
        row = self._rows[seq]
        hits, made = row.guesses
        row.guesses = (hits * GUESS_DECAY + right, made * GUESS_DECAY + 1)

    def _guess_rate(self, row: _Row) -> float:
        """A row's rate of right guesses, its prior the chance its first draft is accepted (a
        guess is that draft's test, one step early)."""
        hits, made = row.guesses
        prior = row.adaptive.rates(LOOKUP)[0]
        return (hits + prior * PRIOR_WEIGHT) / (made + PRIOR_WEIGHT)

    def choose(self, seqs: list[Sequence], hold: bool) -> StepChoice:
        """A synchronous step's drafting: each row past its first step proposes the K its running
        acceptance pays for (adaptive K) or its own K; nothing when the step is held (`hold`). In
        a step the gate let speculate, a row verifies only the drafts likely enough to add a
        token to pay for their verification at this batch size (`BatchGate.floor`)."""
        own = [s for s in seqs if not s.first_step and s.k]
        caps = [0 if hold or self._idle(s) else s.k for s in own]
        chosen: dict[Sequence, tuple[Plan, int]] = {}
        for seq, plan in zip(own, self.proposer.plan(own, caps), strict=True):
            adaptive = self._rows[seq].adaptive
            chosen[seq] = plan, plan.limit if adaptive is None else self._depth(adaptive, plan.source, plan.limit)
        depths = [chosen[s][1] if s in chosen else 0 for s in seqs]
        self._drafted = sum(depths) + sum(len(s.received.token_ids) for s in seqs if s.first_step and not hold)
        return StepChoice([chosen[s][0] if s in chosen else None for s in seqs], depths)

    def calibrate(self, target: CausalLM, draft: CausalLM | None, verifier: Verifier, measure: bool) -> StepCosts:
        """Measure adaptive K's cost table on these models (`engine/adaptive.calibrate`), as this
        node runs a K = 0 step (queued, with async scheduling); a no-op without adaptive K or
        when not `measure` (a table configured)."""
        if not self.spec.adaptive or not measure:
            return self.costs
        self.costs = calibrate(target, draft, verifier, self.spec.max_speculative_tokens, self.pipelined)
        self._measured = True
        log.info(
            "adaptive K step costs: verify %s, draft depth %.2f, K = 0 read back %.2f, verify queued ahead %s",
            self.costs.verify,
            self.costs.depth,
            self.costs.sync,
            self.costs.ahead,
        )
        return self.costs

    def timed(self, seconds: float) -> None:
        """The wall time of this step, for the batch gate when it chose the step's kind."""
        if self._gated is not None:
            rows, speculated = self._gated
            self.gate.record(rows, speculated, seconds, self._drafted, self._expected, self._emitted)
            self._gated = None

    # -- what a step showed ---------------------------------------------------------------
    def verified(self, seq: Sequence, source: str | None, depth: int, accepted: int) -> None:
        """A synchronous step's outcome for a row: `depth` drafts from `source` (None: none; PREFILL:
        the prefill's proposal, which says nothing of this node's choices for the row, but tells
        the node how its newcomers' proposals fare), the first `accepted` accepted. A step the
        batch gate held is no observation: its counts would decay toward the prior, held step
        after held step, until the gate, reading the rows' E(K), let a batch whose drafts do not
        pay speculate again; the gate probes for the rows it holds (`BatchGate.allows`)."""
        self._emitted += accepted + 1
        self._observe(seq, source, depth, accepted)

    def ran_plain(self, seq: Sequence) -> None:
        """A row that may speculate ran a queued K = 0 step. That step was decided one step ago,
        and `gated` is the step now queued's: the two differ only where the gate changed its
        mind, by one decay. (Read while the next step runs: none of that step's tokens.)"""
        self._observe(seq, None, 0, 0)

    def _observe(self, seq: Sequence, source: str | None, depth: int, accepted: int) -> None:
        row = self._rows[seq]
        if row.adaptive is not None and not row.gated:  # a held step drafted nothing
            row.adaptive.observe(None if source == PREFILL else source, depth, accepted)
            self.shown.count(source, depth, accepted)

    def advanced(self, seq: Sequence) -> None:
        """A row's context grew (it goes on): a match-driven row looks for its next match now, so
        the step after next knows whether it may draft before this one is read."""
        if self.proposer.match_driven and seq.k:
            row = self._rows[seq]
            row.may_draft, row.hit = row.hit, None if self._firm else self._hit(seq, row)

    def _look_up(self, seqs: list[Sequence]) -> None:
        """The matches of the rows whose contexts grew while the gate held their batch firmly
        (`hold`), looked up now: their contexts are those `advanced` would have looked up."""
        for seq in seqs:
            row = self._rows[seq]
            if row.hit is None:
                row.hit = self._hit(seq, row)
                if row.may_draft is None:  # not known either: the newer context stands in
                    row.may_draft = row.hit

    # -- internals ----------------------------------------------------------------------
    def _gain(self, seq: Sequence, in_flight: bool) -> float:
        """The tokens a row expects from this step if the batch speculates."""
        if seq.plain:
            return 1.0
        row = self._rows[seq]
        if seq.first_step:  # the prefill's proposal, at the acceptance the node's newcomers have shown
            return row.adaptive.expected(PREFILL, len(seq.received.token_ids), self.shown.rates(PREFILL))
        if self.proposer.match_driven:  # chosen when its context last grew (`_hit`)
            if self._idle(seq, in_flight):
                return 1.0
            source, k = row.planned
        else:
            plan = self.proposer.plan([seq], [seq.k])[0]
            source, k = plan.source, row.adaptive.choose(plan.source, plan.limit, self.costs)
        return self._tokens(row.adaptive, source, k)

    def _tokens(self, adaptive: AdaptiveK, source: str, k: int) -> float:
        """E of a row's K = k drafts from `source` in this step: of those the floor admits, at the
        row's rates over the node's."""
        shown = self.shown.rates(source)
        return adaptive.expected(source, adaptive.admitted(source, k, self._floor, shown), shown)

    def _best(self, seq: Sequence, in_flight: bool) -> tuple[float, bool]:
        """An upper bound of the row's `_gain` that looks nothing up, and whether it is the gain
        itself: for a row whose match is not known (or a method that looks up while pricing),
        the tokens it would expect if its context offered all its K drafts from its best source
        (E(K), the K adaptive K chooses and the drafts the floor admits all grow with the drafts
        offered)."""
        if seq.plain or seq.first_step or (self.proposer.match_driven and self._rows[seq].hit is not None):
            return self._gain(seq, in_flight), True
        adaptive = self._rows[seq].adaptive
        costs = self.costs.drafting_ahead() if self._drafts_ahead(seq) else self.costs
        return max(
            self._tokens(adaptive, source, adaptive.choose(source, seq.k, costs)) for source in self.proposer.sources
        ), False

    def _depth(
        self, adaptive: AdaptiveK, source: str, limit: int, costs: StepCosts | None = None, lead: float = 1.0
    ) -> int:
        """A row's K: what adaptive K pays for (at `costs`, the node's table unless given; `lead`:
        `AdaptiveK.choose`'s), of which this step's floor admits the first ones."""
        k = adaptive.choose(source, limit, costs or self.costs, lead)
        return adaptive.admitted(source, k, self._floor, self.shown.rates(source), lead) if self._floor else k

    def _batch_free(self, seq: Sequence) -> bool:
        """Whether the row's tokens may depend on what else is in the batch: not for a seeded
        sampled row, unless its proposals are point masses verified by coupling (prompt
        lookup; a first step's proposal from the prefill node is one when it carries no law)."""
        if seq.params.is_greedy or seq.params.seed is None:
            return True
        if seq.first_step:
            return seq.received.probs is None
        return self.proposer.match_driven

    def _idle(self, seq: Sequence, in_flight: bool = False) -> bool:
        """A match-driven row whose next step cannot draft, past its first step. The context after
        the step before the last decides: `hit` while the row's last step is still in flight,
        `may_draft` once it is read."""
        if not self.proposer.match_driven or not seq.k or seq.first_step or seq.logprobs or seq.grammar:
            return False
        row = self._rows[seq]
        return (row.hit if in_flight else row.may_draft) is False  # None: not looked up, it may draft

    def _hit(self, seq: Sequence, row: _Row) -> bool:
        """Whether the context as it is now has a match that adaptive K would draft, and, with
        async scheduling, one worth the wait for the token in flight (`pays_to_wait`)."""
        plan = self.proposer.plan([seq], [seq.k])[0]
        if row.adaptive is None:
            return plan.limit > 0
        ahead = self._drafts_ahead(seq)
        costs = self.costs.drafting_ahead() if ahead else self.costs
        k = row.adaptive.choose(plan.source, plan.limit, costs) if plan.limit else 0
        row.planned = plan.source, k
        if not self.pipelined or ahead:  # no wait for the step in flight
            return k > 0
        return k > 0 and row.adaptive.pays_to_wait(plan.source, k, self.costs)

    def _drafts_ahead(self, seq: Sequence) -> bool:
        """Whether the row may draft in a step queued before its step in flight is read (`ahead`)."""
        return (
            self.drafting_ahead
            and self.proposer.match_driven
            and bool(seq.k)
            and not seq.logprobs
            and seq.grammar is None
            and seq.candidates == 1
        )
