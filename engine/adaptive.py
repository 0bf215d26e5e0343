"""Adaptive K: how many tokens to draft for one request in one step.

A verify of K drafts emits E(K) = 1 + sum_{i<K} prod_{j<=i} a_j tokens in expectation, where a_j
is the chance that draft j is accepted given that the drafts before it were; it costs verify[K]
+ K * depth target steps (`StepCosts`: a verify of K+1 tokens per row, and one draft-model
depth, each relative to a K = 0 step). Each step picks the K in 0..limit with the most expected
tokens per unit of cost; K = 0 (1 token for 1 step) whenever drafting does not pay.

The a_j are the request's own: counts of accepted / tested drafts at each position, with a prior
of `PRIOR` worth `PRIOR_WEIGHT` observations, decayed by `DECAY` every step (K = 0 steps too),
so a request whose drafts stopped paying probes again after a while, and one whose text turns
repetitive finds out. Steps the batch gate (`BatchGate`) holds at K = 0 are not counted: the
gate probes for the rows it holds (engine/spec_policy.py). The choice reads only the request's
own history and a cost table fixed when the node starts, so a seeded request draws the same
tokens whatever else runs beside it; and since K depends only on the past, never on the step's
uniforms, the verifier's output law is unchanged. Point-mass proposals (prompt lookup) go
further: verified by coupling (sampling/verifier.py), a seeded request draws the tokens it would
at K = 0, whatever K is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.base import CausalLM
from models.eagle import EagleDraft
from sampling import RequestRng, SamplingParams, Verifier, VerifyBatch

PRIOR = 0.5  # acceptance assumed before a request has shown any
PRIOR_WEIGHT = 1.0  # observations the prior is worth
DECAY = 0.9  # per step: the weight of what a request showed one step ago
RESCALE = 1e-6  # AdaptiveK's stored counts are folded back to their scale below it
QUEUED = 8  # K = 0 steps queued back to back when timing a pipelined K = 0 step


@dataclass(frozen=True)
class StepCosts:
    """What a step costs, in K = 0 steps: verify[k] for k drafts per row (verify[0] = 1),
    `depth` per draft-model depth (prompt lookup drafts for free), `sync`, a K = 0 step read
    back before the next is queued (1 without async scheduling, where every step is), and
    ahead[k], a verify of k drafts queued before the step in flight is read, as a greedy
    prompt-lookup row speculates with async scheduling (empty: as `verify`)."""

    verify: tuple[float, ...]
    depth: float = 0.0
    sync: float = 1.0
    ahead: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.verify or any(c <= 0 for c in (*self.verify, *self.ahead)) or self.depth < 0 or self.sync < 1:
            raise ValueError(f"step costs: expected positive verify costs, depth >= 0 and sync >= 1, got {self}")

    def drafting_ahead(self) -> StepCosts:
        """The table of a row that drafts ahead of its step in flight: its verify is queued, no
        step is read back before it."""
        return StepCosts(self.ahead or self.verify, self.depth)

    def of(self, k: int, drafted: bool) -> float:
        verify = self.verify[min(k, len(self.verify) - 1)]
        return verify + (k * self.depth if drafted else 0.0)

    @classmethod
    def measure(
        cls,
        verify_step: Callable[[int], None],
        draft_depth: Callable[[], None] | None,
        max_k: int,
        queued_steps: Callable[[int, int], None] | None = None,
    ) -> StepCosts:
        """Time `verify_step(k)` (one target pass of k+1 tokens and its verification, read back)
        for k in 0..max_k and `draft_depth()` (one draft forward), best of a few runs each,
        relative to a K = 0 step: `verify_step(0)`, or with async scheduling a share of
        `queued_steps(n, 0)` (n K = 0 steps queued back to back and read once), which is what a
        K = 0 step costs there — a synchronous speculating step is read before the next is
        queued; and there `queued_steps(n, k)`, n verifies of k drafts queued so, for `ahead`."""

        def best(fn: Callable[[], None]) -> float:
            fn()  # warm-up: first-use allocation, graph capture, kernel compilation
            times = []
            for _ in range(5):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            return min(times)

        step = [best(lambda k=k: verify_step(k)) for k in range(max_k + 1)]
        base = step[0] if queued_steps is None else min(step[0], best(lambda: queued_steps(QUEUED, 0)) / QUEUED)
        depth = best(draft_depth) / base if draft_depth is not None else 0.0
        ahead = ()
        if queued_steps is not None:
            ahead = _costs(
                [base, *(best(lambda k=k: queued_steps(QUEUED, k)) / QUEUED for k in range(1, max_k + 1))], base
            )
        return cls(_costs(step, base), depth, max(1.0, step[0] / base), ahead)


def _costs(times: list[float], base: float) -> tuple[float, ...]:
    """Times of verifies of 0.. drafts as costs relative to `base`: never below a K = 0 step's
    nor a verify of fewer drafts (timer noise would bias K upwards)."""
    costs = [1.0]
    for t in times[1:]:
        costs.append(max(1.0, t / base, costs[-1]))
    return tuple(costs)


class AdaptiveK:
    """One request's running acceptance, per proposal source and position, and its choice of K."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._counts: dict[str, tuple[list[float], list[float]]] = {}  # source -> (accepted, tested) per position
        # The counts are the stored ones times `_scale`: a decay, every row's every step, scales
        # one number instead of every count (folded back in once it falls below RESCALE).
        self._scale = 1.0
        # Answers from the counts as they are (`rates`, `choose`, `pays_to_wait`), kept until they
        # change: a step asks for a row's rates several times (its K, its gain, its admitted drafts)
        # and for the node's rows' (`SpecPolicy.shown`) once per row; and a row the batch gate
        # holds shows nothing, so its K and its wait are the same step after step.
        self._known: dict[tuple, object] = {}

    def _of(self, source: str) -> tuple[list[float], list[float]]:
        if source not in self._counts:
            self._counts[source] = ([0.0] * self.cap, [0.0] * self.cap)
        return self._counts[source]

    def rates(self, source: str, prior: list[float] | None = None) -> list[float]:
        """a_j for j in 0..cap-1: the chance draft j is accepted given the ones before were. Each
        position's prior is the rate of the position before it (PRIOR for the first), so a
        position never tested yet is expected to do as its predecessor does; or, given `prior`
        (at least cap rates, e.g. the node's), that position's rate there. Kept until the counts
        change: the caller reads the list, never writes it. Of the rates over a `prior`, only those
        over the latest one are kept: the node's rates move every step, and a row the batch gate
        holds keeps its counts (so its answers) step after step, so keeping each would grow its
        table by one entry a step."""
        key = ("rates", source, prior is not None)
        kept = self._known.get(key)  # (the prior asked with, a copy of its values, the rates)
        # the prior is usually the very list asked with before (the node's rates, kept per step)
        if kept is None or not (kept[0] is prior or kept[1] == tuple(prior)):
            accepted, tested = self._of(source)
            scale, out, rate = self._scale, [], PRIOR
            for j, (a, t) in enumerate(zip(accepted, tested, strict=True)):
                base = rate if prior is None else prior[j]
                rate = (a * scale + base * PRIOR_WEIGHT) / (t * scale + PRIOR_WEIGHT)
                out.append(rate)
            kept = self._known[key] = (prior, None if prior is None else tuple(prior), out)
        return kept[2]

    def expected(self, source: str, k: int, prior: list[float] | None = None) -> float:
        """E(k): the tokens a verify of k drafts from `source` emits in expectation (`prior`: as
        in `rates`)."""
        expected, reach = 1.0, 1.0
        for a in self.rates(source, prior)[:k]:
            reach *= a
            expected += reach
        return expected

    def choose(self, source: str, limit: int, costs: StepCosts, lead: float = 1.0) -> int:
        """The K in 0..min(limit, cap) with the most expected tokens per unit of cost (the cost
        table is a batch-1 table: `BatchGate` decides for a batch as a whole). `lead`: the chance
        the drafts continue the right context at all (a row drafting ahead of a guessed token:
        a wrong guess rejects them all), which every draft's chance of adding a token carries."""
        limit = min(limit, self.cap)
        key = ("choose", source, limit, costs, lead)
        if key in self._known:
            return self._known[key]
        best_k, best_rate = 0, 1.0  # K = 0: one token for one step
        expected, reach = 1.0, lead
        for k, a in enumerate(self.rates(source)[:limit], start=1):
            reach *= a
            expected += reach
            rate = expected / costs.of(k, source == "draft")
            if rate > best_rate:
                best_k, best_rate = k, rate
        self._known[key] = best_k
        return best_k

    def admitted(self, source: str, k: int, floor: float, prior: list[float] | None = None, lead: float = 1.0) -> int:
        """Of k drafts from `source`, how many to verify: those whose chance of adding a token
        (every draft up to them accepted) is at least `floor` (`BatchGate.floor`; `prior`: as in
        `rates`; `lead`: as in `choose`). The chance falls with the position, so they are the
        first ones."""
        reach = lead
        for j, a in enumerate(self.rates(source, prior)[:k]):
            reach *= a
            if reach < floor:
                return j
        return k

    def pays_to_wait(self, source: str, k: int, costs: StepCosts) -> bool:
        """With async scheduling: whether a row that could draft `k` from `source` after the step
        in flight should make the step after it wait for that step's token (the proposal needs
        it). The wait pays off only if that token continues the match, about as likely as a
        first draft's acceptance (a_0); otherwise the row has paid a K = 0 step read back
        (`costs.sync`) for one token. Measured in tokens minus K = 0 steps."""
        key = ("wait", source, k, costs)
        if key not in self._known:
            a = self.rates(source)[0]
            surplus = self.expected(source, k) - costs.of(k, source == "draft")
            self._known[key] = a * surplus > (1 - a) * (costs.sync - 1)
        return self._known[key]

    def observe(self, source: str | None, depth: int, accepted: int) -> None:
        """One step: `depth` drafts proposed by `source` (None: none), the first `accepted` accepted.
        Every source's counts decay, drafted this step or not."""
        self.decay(DECAY)
        self.count(source, depth, accepted)

    def decay(self, factor: float) -> None:
        self._known.clear()
        self._scale *= factor
        if self._scale < RESCALE:
            for acc, tested in self._counts.values():
                acc[:] = [a * self._scale for a in acc]
                tested[:] = [t * self._scale for t in tested]
            self._scale = 1.0

    def count(self, source: str | None, depth: int, accepted: int) -> None:
        """`depth` drafts proposed by `source` (None: none), the first `accepted` accepted."""
        if source is None or depth == 0:
            return
        self._known.clear()
        acc, tested = self._of(source)
        one = 1.0 / self._scale  # a count of 1, stored
        for j in range(min(depth, accepted + 1, self.cap)):  # drafts past the first rejection were not tested
            tested[j] += one
            if j < accepted:
                acc[j] += one


class BatchGate:
    """Whether speculating pays for a batch as a whole, from the steps the node has run.

    `StepCosts` is measured at batch 1. In a larger batch a step that verifies drafts costs
    more than its rows' tables say: it cannot be queued before the step in flight is read (a
    K = 0 step can), and its per-row host work grows with the batch. So for each batch-size
    bucket (powers of two) the node keeps the smoothed wall time of its K = 0 steps and of its
    speculating steps, and speculates only while the tokens the rows expect from it (their
    own E(K)) per second beat one token per row per K = 0 step; every `PROBE_EVERY` steps it
    runs `PROBE_STEPS` of the other kind, so a change in either time is seen. A step right
    after one of the other kind is not timed: the first queued K = 0 step also reads nothing
    yet, and the first speculating one waits for the K = 0 step still in flight. Within a step it
    lets speculate, a draft is verified only if it is likely enough to add a token (`floor`:
    what a drafted token adds to the step's time, fitted on the speculating steps' times over
    their drafted tokens, against what a token takes at K = 0), so the rows whose drafts do not
    pay at this batch size run at K = 0 beside those whose drafts do. The engine gates only rows
    whose tokens do not depend on K (point-mass proposals verified by coupling,
    sampling/verifier.py): a seeded row's tokens may not depend on what else is in the batch.

    The rows' E(K) is itself a forecast, and a biased one: a row drafts when its estimate looks
    good, so the steps that speculate are those whose rows' estimates ran high. The gate keeps
    the tokens its speculating steps actually emitted over the tokens their rows expected
    (`realism`, smoothed over those steps, every batch size together) and prices a step's
    expectation at that rate, so a forecast that keeps running high stops paying for itself."""

    PROBE_EVERY = 64  # steps between probes of the other kind, at least
    PROBE_STEPS = 3
    PROBE_SHARE = 0.05  # of the time at K = 0, the most that probing a slower speculating step may take
    SMOOTHING = 0.25  # weight of the newest step in a time
    FIT_SMOOTHING = 0.1  # weight of the newest speculating step in the fit of its time on its drafts
    FIT_STEPS = 8  # speculating steps fitted before the fit is used
    FIT_SPREAD = 1.0  # the least variance of their drafted tokens (tokens^2) that tells a slope
    REALISM_SMOOTHING = 0.1  # weight of the newest speculating step in `realism`
    REALISM_RANGE = (0.5, 1.5)  # how far measured outcomes may move the rows' forecasts

    def __init__(self) -> None:
        self._times: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> seconds per step
        self._since: dict[int, int] = {}  # bucket -> steps since the other kind last ran
        self._last: tuple[int, bool] | None = None  # the kind of the step before
        # bucket -> speculating steps fitted, and the weighted means of D, S, D^2 and D*S (D: drafted
        # tokens, S: seconds)
        self._fit: dict[int, list[float]] = {}
        self.realism = 1.0  # tokens the speculating steps emitted over those their rows expected

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << (batch - 1).bit_length()

    def time(self, batch: int, speculated: bool) -> float | None:
        return self._times.get((self.bucket(batch), speculated))

    def _times_at(self, bucket: int) -> tuple[float | None, float | None]:
        """(K = 0, speculating) step times at `bucket`; what it has not timed yet is taken from
        the nearest bucket that timed both, at that bucket's ratio (only the ratio decides), so
        a batch that shrinks as its rows finish does not pay for timing speculation again."""
        plain, spec = self._times.get((bucket, False)), self._times.get((bucket, True))
        if plain is not None and spec is not None:
            return plain, spec
        timed = [b for b, speculated in self._times if speculated and (b, False) in self._times]
        if not timed:
            return plain, spec
        near = min(timed, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
        ratio = self._times[(near, True)] / self._times[(near, False)]
        if plain is not None:
            return plain, plain * ratio
        if spec is not None:
            return spec / ratio, spec
        return self._times[(near, False)], self._times[(near, True)]

    def pays(self, batch: int, expected: float) -> bool | None:
        """Whether `expected` tokens from speculating (at `realism`) beat a K = 0 step for `batch`
        rows, by the times measured so far (None: not both timed yet). Asks nothing of the probes."""
        plain, spec = self._times_at(self.bucket(batch))
        if spec is None or plain is None:
            return None
        return expected * self.realism / spec >= batch / plain

    def allows(self, batch: int, expected: float) -> bool:
        """Whether a step of `batch` rows that expect `expected` tokens in all from speculating
        (at `realism`) may speculate (False: run it at K = 0)."""
        bucket = self.bucket(batch)
        plain, spec = self._times_at(bucket)
        if spec is None or plain is None:
            return spec is None  # time speculating first, then K = 0
        speculate = self.pays(batch, expected)
        # Probing a speculating step that costs r K = 0 steps every n steps costs PROBE_STEPS * r / n.
        every = (
            self.PROBE_EVERY if speculate else max(self.PROBE_EVERY, self.PROBE_STEPS * spec / plain / self.PROBE_SHARE)
        )
        since = self._since.get(bucket, 0) + 1
        probe = since > every
        self._since[bucket] = 0 if since >= every + self.PROBE_STEPS else since
        return speculate != probe

    def record(
        self, batch: int, speculated: bool, seconds: float, drafted: int = 0, expected: float = 0.0, emitted: int = 0
    ) -> None:
        """The wall time of one step of `batch` rows that verified `drafted` drafts in all; a
        speculating step's rows expected `expected` tokens of it (the E(K) the gate priced) and
        emitted `emitted` (0 and 0: not known)."""
        if speculated and expected > 0:
            low, high = self.REALISM_RANGE
            ratio = min(high, max(low, emitted / expected))
            self.realism += self.REALISM_SMOOTHING * (ratio - self.realism)
        key = (self.bucket(batch), speculated)
        last, self._last = self._last, key
        if last != key or seconds <= 0:
            return
        old = self._times.get(key)
        self._times[key] = seconds if old is None else old + self.SMOOTHING * (seconds - old)
        if speculated:
            fit = self._fit.setdefault(key[0], [0.0] * 5)
            fit[0] += 1
            weight = max(self.FIT_SMOOTHING, 1 / fit[0])
            for i, value in enumerate((drafted, seconds, drafted * drafted, drafted * seconds), start=1):
                fit[i] += weight * (value - fit[i])

    def floor(self, batch: int) -> float:
        """The least chance a draft must have of adding a token (its row's drafts up to it all
        accepted) to pay for its verification in a speculating step of `batch` rows: the seconds
        a drafted token adds to that step (the slope of the step's time over its drafted tokens,
        fitted on the steps this node ran) over the seconds a token takes at K = 0 (a K = 0
        step's time over `batch`). 0 (every draft pays) until both are known."""
        bucket = self.bucket(batch)
        fit, plain = self._fit.get(bucket), self._times.get((bucket, False))
        if fit is None or plain is None or fit[0] < self.FIT_STEPS:
            return 0.0
        _, d, s, dd, ds = fit
        spread = dd - d * d
        if spread < self.FIT_SPREAD:
            return 0.0
        return max(0.0, (ds - d * s) / spread) / (plain / batch)


def calibrate(target: CausalLM, draft: CausalLM | None, verifier: Verifier, max_k: int, queued: bool) -> StepCosts:
    """The cost table of these models (`StepCosts.measure`): a verify of k + 1 tokens and its
    rejection sampling for k in 0..max_k at batch 1 after a short context, and one draft depth
    (none without a draft), relative to a K = 0 step read back or, `queued` (async scheduling),
    queued back to back. Every state it makes is released."""
    context = 32
    runs = 12 * (max_k + 2) + QUEUED * (max_k + 1)  # the tokens the timed runs add, and a queued run's chains
    prompt = [i % target.vocab_size for i in range(context)]
    params, rng = SamplingParams(), RequestRng(0, stream="calibrate")
    states = []
    try:
        state = target.empty_state()
        states.append((target, state))
        target.reserve(state, context + runs + max_k + 1)
        target.extend_last([state], [prompt])

        def verify(logits: list[torch.Tensor], k: int):
            drafts = torch.ones(1, k, dtype=torch.int64)
            return verifier.verify(VerifyBatch(drafts), torch.stack(logits).to(verifier.device), [params], [rng])

        def verify_step(k: int) -> None:
            verify(target.extend_tree([state], [[1] * (k + 1)], [list(range(-1, k))]), k).host()
            target.accept_tree(state, [0])  # one token kept per run: the state grows by one

        def queued_steps(n: int, k: int) -> None:  # chains of k drafts queued, the last read
            length = len(state.tokens)
            results = [verify(target.extend_batch([state], [[1] * (k + 1)]), k) for _ in range(n)]
            results[-1].host()
            target.truncate(state, length + 1)  # one token kept per run: the state grows by one

        depth = None
        if draft is not None:
            draft_state = draft.empty_state()
            states.append((draft, draft_state))
            draft.reserve(draft_state, context + runs)
            draft.extend_last([draft_state], [prompt])

            if isinstance(draft, EagleDraft):  # a head drafts by chain steps (graph replays on a GPU)
                token = torch.ones(1, dtype=torch.int64, device=draft.device)
                hidden = torch.zeros(1, draft.config.hidden_size, dtype=draft.dtype, device=draft.device)

                def depth() -> None:  # a chain of one step, its stacking copy included
                    draft.chain([draft_state], 1).step(token, hidden)[0].argmax(-1).item()
            else:

                def depth() -> None:
                    draft.extend_batch([draft_state], [[1]])[0].argmax(-1).item()

        return StepCosts.measure(verify_step, depth, max_k, queued_steps if queued else None)
    finally:
        for model, made in states:
            model.release(made)
