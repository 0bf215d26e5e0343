"""The decode engine: a continuous-batching scheduler over sequences, no gRPC inside.

Each request arrives validated (`protos.validation.DecodeInput`) and becomes a `Sequence`
(engine/sequence.py). Its KV came in the message or arrives after it (DecodeStream, shared
memory): such a request's target KV is reserved in arrival order, the servicer writes the
bytes straight into it, and the request is admitted once they are all in. Each step admits
what fits (slots and KV blocks), asks the speculation policy (engine/spec_policy.py) what to
run, and runs it for every active sequence: the speculative step of engine/spec_step.py, or,
with async scheduling (on a GPU by default), a step queued before the step before it is read
(`spec_step.queue`: K = 0, or prompt-lookup rows drafting ahead; docs/design.md §9 "Async
scheduling"). A row that finished in step n also ran in a queued step n+1: that token is
dropped, and its KV is freed once step n+1 is read. Emitted tokens go to the request's event
queue; the servicer streams them. Paused readers and preemption (KV recomputed when resumed)
keep waits bounded: decode_node/fairness.py.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from common.transfer import Buffer
from decode_node.config import DecodeConfig
from decode_node.fairness import Fairness, claim_state, recompute
from decode_node.request import Event, QueueFull, Request
from engine import grammar, spec_step
from engine.adaptive import StepCosts
from engine.device import on_device
from engine.proposer import Proposer
from engine.proposers import proposer_for
from engine.sequence import Sequence
from engine.spec_policy import SpecPolicy
from models.base import import_tensors
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics
from protos.validation import DecodeInput
from sampling import Verifier
from sampling.logprobs import TokenLogprob
from sampling.proposal import LOOKUP, PREFILL, Proposal

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """An async-scheduled step queued on the device, not yet read: its rows' requests, and what
    each row's drafts assumed of the step before it (`_Guess`; None: nothing, it knew its context)."""

    requests: list[Request]
    queued: spec_step.Queued
    guesses: list[_Guess | None]


@dataclass(frozen=True)
class _Guess:
    """A row drafting ahead of its step in flight assumed that step accepts `accepted` of its
    drafts and then emits `token`: the context its drafts continue."""

    accepted: int
    token: int


class DecodeEngine:
    def __init__(
        self,
        pair: ModelPair,
        config: DecodeConfig,
        metrics: NodeMetrics | None = None,
        verifier: Verifier | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`verifier` and `proposer` default to the config's; a caller may give its own (a
        benchmark drafting at a known acceptance rate, a test's recording sampler)."""
        self.pair = pair
        self.config = config
        self.metrics = metrics
        # Draft ids were validated at the wire (protos/validation) or come from d2t: no value
        # checks, which would each make the host wait for the step's forward.
        self.verifier = verifier or Verifier(config.sampler_backend, config.device, check_values=False)
        self.proposer = proposer or proposer_for(pair, config.spec, config.device)
        self.grammars = grammar.Grammars.for_pair(pair)  # structured outputs (compiled on submitting threads)
        costs = config.step_costs or StepCosts((1.0,) * (config.spec.max_speculative_tokens + 1))
        ahead = self.pipelined and config.speculate_ahead == "on"
        self.policy = SpecPolicy(config.spec, self.proposer, costs, self.pipelined, ahead)
        self.fairness = Fairness(config.max_batch, config.preempt_after_steps, config.pause_backlog, metrics)
        self._lock = threading.Condition()
        self._pending: list[Request] = []
        self._active: list[Request] = []
        self._outbox: list[tuple[Request, Event]] = []  # events made, not yet handed to their streams (step)
        self._inflight: _InFlight | None = None  # async scheduling: the step queued and not yet read
        # a row whose step in flight drafted on a context that proved wrong (its guess of the step
        # before): its next step assumes that step accepts nothing
        self._misguessed: set[Request] = set()
        self._running = False
        self._thread: threading.Thread | None = None

    # -- requests -------------------------------------------------------------------
    def sequence(self, decode_input: DecodeInput) -> Sequence:
        """A request's sequence, every default resolved (`Sequence.decoding`; GrammarError: no compile)."""
        eos, budget = self.pair.target.eos_token_ids, self.config.default_max_new_tokens
        return Sequence.decoding(decode_input, eos, budget, self.proposer.method, self.grammars)

    def submit(self, decode_input: DecodeInput, *, streamed: bool = False) -> Request:
        """Queue a request (QueueFull when it can never fit or the queue is full). `streamed`: its
        KV comes later; its target KV is reserved when its turn comes (at once when nothing waits
        ahead of it), `request.reserved` is set, and the caller writes the bytes (import_chunk)
        and calls imported(), or cancel()."""
        seq = self.sequence(decode_input)
        request = Request(decode_input, seq, self._kv_need(seq), streamed=streamed)
        for role, model in self._kv_models():
            capacity = model.capacity_tokens()
            if capacity is not None and request.kv_need > capacity:
                raise QueueFull(
                    f"the request needs {request.kv_need} KV positions, the {role} KV cache holds {capacity}"
                )
        with self._lock:
            if len(self._pending) + len(self._active) >= self.config.max_batch + self.config.max_queue:
                raise QueueFull(f"{self.config.max_batch} running and {self.config.max_queue} queued")
            if streamed and all(r.seq.target_state is not None for r in self._pending):
                self._claim(request)  # nothing waits for KV ahead of it: the upload need not wait for a step
            self._pending.append(request)
            self._lock.notify()
        return request

    def receive(self, request: Request, decode_input: DecodeInput) -> int:
        """The first token and proposal of a streamed request whose proposal came last (submitted
        with its header's input): its sequence is made anew from the whole input, keeping the KV
        reserved for it, unless it needs more KV positions than were reserved. Returns the
        positions it needs."""
        seq = self.sequence(decode_input)
        needed = self._kv_need(seq)
        if needed <= request.kv_need:
            with self._lock:
                seq.target_state = request.seq.target_state
                request.input, request.seq = decode_input, seq
        return needed

    def _kv_need(self, seq: Sequence) -> int:
        """KV positions a sequence may ever occupy with the largest proposal it may verify."""
        own = self.proposer.max_nodes(seq.k, seq.candidates)
        return seq.kv_need(max(len(seq.received.token_ids), own))

    def cancel(self, request: Request) -> None:
        """Drop a request: a queued one leaves the queue now (with any KV reserved for it), a
        running one at the next step. A streamed request's writer calls it only once it has
        stopped writing."""
        request.cancelled.set()
        with self._lock:
            if request in self._pending:
                self._pending.remove(request)
                self._retire(request)

    def import_chunk(self, request: Request, index: int, offset: int, data: Buffer) -> None:
        """Bytes [offset, offset + len(data)) of KV tensor `index` of a reserved streamed request."""
        self.pair.import_chunk(request.seq.target_state, index, offset, data)  # the pair's layout

    def imported(self, request: Request) -> None:
        """Every KV byte of a streamed request written: it is admitted when a slot is free."""
        self.pair.finish_import(request.seq.target_state)
        with self._lock:
            request.imported = True
            self._lock.notify()

    def _kv_models(self) -> list[tuple[str, object]]:
        """The models that hold KV for a request (no draft KV where the proposer uses no draft model)."""
        return [("target", self.pair.target), *([("draft", self.pair.draft)] if self.proposer.uses_draft else [])]

    @property
    def pipelined(self) -> bool:
        """Async scheduling is on: configured so, and the target takes its input tokens from the device."""
        return self.config.pipelined and getattr(self.pair.target, "device_tokens", False)

    @property
    def load(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._active)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def calibrate(self) -> StepCosts:
        """Measure adaptive K's cost table on this node's models (`SpecPolicy.calibrate`).
        Start-up only (the engine thread is not running)."""
        draft = self.pair.draft if self.proposer.uses_draft else None
        with on_device(self.config.device):
            return self.policy.calibrate(self.pair.target, draft, self.verifier, measure=self.config.step_costs is None)

    # -- the loop ---------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._running = False
            self._lock.notify()
        if self._thread:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._running and not self._pending and not self._active:
                    self._lock.wait()
                if not self._running:
                    break
            self.step(deliver=False)
        try:
            self._drain()
        except Exception:
            log.exception("reading the last step failed")
        self._deliver()

    def step(self, deliver: bool = True) -> None:
        """Admit waiting requests (in arrival order, while slots and KV blocks last), then one
        step for every active one. Every request that leaves frees its KV. deliver=False (the
        engine's own loop): the events stay in the outbox until the next step has queued its GPU
        work, so the stream threads they wake take the GIL while this thread waits for the GPU
        (docs/design.md §9 "Host waits per step")."""
        started = time.perf_counter()
        with on_device(self.config.device):
            ran = self._step()
        self.policy.timed(time.perf_counter() - started)
        if deliver or not (ran and self._active):  # nothing ran (none left, or all paused): now
            self._deliver()
        if ran and self.metrics:
            self.metrics.engine_step.labels("decode").observe(time.perf_counter() - started)

    def _emit(self, request: Request, event: Event) -> None:
        self._outbox.append((request, event))

    def _deliver(self) -> None:
        """Hand the outbox's events to their streams, in the order they were made, once the
        speculation counts of the steps that made them are published (`NodeMetrics.flush`)."""
        if self.metrics:
            self.metrics.flush()
        outbox, self._outbox = self._outbox, []
        for request, event in outbox:
            request.events.put(event)

    def _step(self) -> bool:
        """One step; False when no request was running (nothing was timed)."""
        self._preempt()
        admitted = []
        with self._lock:
            room = self.config.max_batch - len(self._active)
            # A streamed request takes its KV before it takes a slot: its upload runs while it waits.
            for request in sorted(self._pending, key=self.fairness.rank):  # newcomers, then the preempted
                if self.fairness.paused(request):
                    continue  # preempted, and its client still reads nothing: not a reason to hold the rest
                if (len(admitted) >= room and not request.streamed) or not self._claim(request):
                    break  # what is behind it waits its turn
                if len(admitted) < room and (request.imported or not request.streamed):
                    self._pending.remove(request)
                    admitted.append(request)
            if not admitted and all(map(self.fairness.paused, self._active)):
                self._lock.wait(0.01)  # nothing can start or run now (no slot or KV, no reader): do not spin
            # Counted as running from the moment they leave the queue: submit's bound holds meanwhile.
            self._active += admitted
        for request in admitted:
            try:
                self._admit(request)
            except Exception as err:  # it leaves at this step's sweep
                log.exception("admission failed")
                self._emit(request, Event([], finished=True, error=f"admission failed: {err}"))
                request.cancelled.set()
        inflight = self._inflight
        unread = set() if inflight is None else set(inflight.requests)  # each brings one token when read
        live = []
        for request in self._active:
            if request.cancelled.is_set():
                continue
            if request.seq.remaining - (request in unread) <= 0:
                if request not in unread:
                    self._finish(request, [], "length")
                continue  # else the token in flight is its last: reading it finishes the request
            if not self.fairness.paused(request):
                live.append(request)
        if not live and inflight is None:
            self._sweep()
            return False
        try:
            hold = bool(live) and self.policy.hold([r.seq for r in live], {r.seq for r in unread})
            ahead = bool(live) and not hold and self.policy.ahead([r.seq for r in live])
            if (hold or ahead) and self.pipelined:
                self._launch(live, speculate=ahead)
            else:
                self._drain()
                live = [r for r in live if not r.cancelled.is_set()]  # those that finished in it are out
                if live:
                    self._speculate(live, hold)
        except Exception as err:  # a bug must not take the node down: fail these requests
            log.exception("decode step failed")
            failed = live + ([] if inflight is None else inflight.requests)
            self._inflight = None
            for request in dict.fromkeys(failed):
                if not request.cancelled.is_set():
                    self._emit(request, Event([], finished=True, error=f"decode step failed: {err}"))
                    request.cancelled.set()
        self._sweep()
        return True

    def _sweep(self) -> None:
        """Retire the requests that left, except those in a step still in flight: the device may
        still write their KV, so their blocks are freed once that step is read."""
        busy = set() if self._inflight is None else set(self._inflight.requests)
        kept = []
        for request in self._active:
            if request.cancelled.is_set() and request not in busy:
                self._retire(request)
            else:
                kept.append(request)
        self._active = kept

    def _claim(self, request: Request) -> bool:
        """Reserve the request's target KV for all it may need (`kv_need`); False when the pools
        cannot hold it now. Called with the lock held, by the engine thread and by submit for an
        upload, so no thread takes blocks between another's check and its reservation. The draft
        KV is reserved at admission: its pool holds as many tokens as the target's, and a request
        holds draft blocks only while it holds target blocks, so it fits then."""
        seq = request.seq
        if seq.target_state is not None or request.cancelled.is_set():
            return True  # reserved already, or admitted only to be retired at once
        if not all(model.can_reserve(request.kv_need) for _, model in self._kv_models()):
            return False
        seq.target_state = claim_state(self.pair, request)
        request.reserved.set()
        return True

    def _retire(self, request: Request, preempted: bool = False) -> None:
        """Free a leaving request's KV (finished, cancelled, expired or failed), or a preempted one's."""
        seq = request.seq
        if seq.target_state is not None:
            self.pair.target.release(seq.target_state)
            seq.target_state = None
        self._misguessed.discard(request)
        self.proposer.stop(seq)
        if not preempted:
            self.policy.forget(seq)

    def _preempt(self) -> None:
        """Free the slots and KV of those `Fairness.step` picks: they requeue, their sequences kept."""
        with self._lock:
            victims = self.fairness.step(self._active, self._pending)
        if self._inflight is not None and set(victims) & set(self._inflight.requests):
            self._drain()  # the device may still write their KV
        for request in victims:
            if not request.cancelled.is_set():  # else it finished in the step just read
                with self._lock:  # from running to waiting in one move: submit's bound holds
                    self._active.remove(request)
                    self._retire(request, preempted=True)
                    self.fairness.preempted(request)
                    self._pending.append(request)

    # -- internals --------------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        """Its KV into the blocks `_claim` reserved (unless streamed there already), and the
        proposer's per-request state of a request that speculates."""
        if request.cancelled.is_set():
            return  # never starts: _retire frees what _claim reserved
        seq, data = request.seq, request.input
        self.fairness.admitted(request)
        if request.preemptions:
            recompute(self.pair.target, seq.history, seq.target_state)
        elif not request.streamed:
            import_tensors(self.pair, seq.target_state, data.kv_cache)
        self.policy.admit(seq)
        if seq.k:  # a request that never drafts needs no drafting state
            self.proposer.start([seq], [request.kv_need])
        if self.metrics and not request.preemptions:
            self.metrics.queue_time.labels("decode").observe(time.monotonic() - request.arrived)
            self.metrics.prompt_tokens.labels("decode").inc(len(seq.prompt))

    def _speculate(self, requests: list[Request], hold: bool) -> None:
        """A synchronous step (engine/spec_step.py) of the depths the policy chose; nothing is
        drafted when the step is held at K = 0 (`hold`)."""
        seqs = [r.seq for r in requests]
        choice = self.policy.choose(seqs, hold)
        for seq, plan, depth in zip(seqs, choice.plans, choice.depths, strict=True):
            if plan is not None:
                self._chose(seq, depth)
        proposals = spec_step.propose(self.proposer, seqs, choice.plans, choice.depths, self.config.device, hold)
        verified = spec_step.verify(self.pair.target, self.pair.draft, self.verifier, seqs, proposals, self._deliver)
        for request, proposal, row in zip(requests, proposals, verified, strict=True):
            seq = request.seq
            self._record(seq, proposal, row)
            self.policy.verified(seq, proposal.source, proposal.depth, len(row.emitted) - 1)
            self._advance(request, row.emitted, row.logprobs)

    def _launch(self, requests: list[Request], speculate: bool = False) -> None:
        """Queue a step for `requests` (async scheduling), then read the step before it: K = 0, or,
        `speculate`, each drafting row drafting ahead of its step in flight (`_ahead`)."""
        previous = self._inflight
        carried = {} if previous is None else {r: i for i, r in enumerate(previous.requests)}
        seqs = [r.seq for r in requests]
        drafts, guesses = [[] for _ in requests], [None] * len(requests)
        if speculate:
            drafts, guesses = self._ahead(requests, previous, carried)
        for seq in seqs:
            seq.received = None  # a first step held at K = 0 drops what it received (or drafted it ahead)
        queued = spec_step.queue(
            self.pair.target,
            self.verifier,
            seqs,
            drafts,
            [carried.get(r) for r in requests],
            None if previous is None else previous.queued,
            self.config.device,
        )
        self._inflight = _InFlight(requests, queued, guesses)
        if previous is None:
            self._deliver()  # queued, and no step before to wait for: the streams run now
        else:
            self._read(previous)  # which delivers before it waits

    def _ahead(
        self, requests: list[Request], previous: _InFlight | None, carried: dict[Request, int]
    ) -> tuple[list[list[int]], list[_Guess | None]]:
        """Each row's drafts for a step queued before its step in flight is read, and what they
        assume of that step. A row new to the batch knows its context and drafts its match (on
        a first step, the prefill's proposal is that same match, dropped). A row in flight
        continues its context as that step would leave it if it accepted all its drafts (or
        none, where those drafts continued a context that proved wrong): that context's match
        guesses the token the step emits, and the match of the context with that token after it
        gives the drafts (where the text repeats itself, a run as long as the row's K, not what
        is left of the context after the occurrence). Where the guess fails the drafts are
        rejected: the tokens stay the target's, only the drafts are lost."""
        found: list[list[int]] = []
        guesses: list[_Guess | None] = []
        for request in requests:
            seq, at = request.seq, carried.get(request)
            room = min(request.kv_need - len(seq.target_state.tokens), seq.remaining) - 1  # drafts that fit
            if not seq.k or room <= 0:
                found.append([])
                guesses.append(None)
            elif at is None:
                found.append(seq.lookup.match(min(seq.k, room))[0])
                guesses.append(None)
            else:
                tail = [] if request in self._misguessed else previous.queued.proposals[at].token_ids
                room -= len(tail) + 1  # the tokens the step in flight emits, as guessed
                token = seq.lookup.match(1, tail)[0] if room > 0 else []
                found.append(seq.lookup.match(min(seq.k, room), [*tail, *token])[0] if token else [])
                guesses.append(_Guess(len(tail), token[0]) if token else None)
        depths = self.policy.ahead_depths(
            [r.seq for r in requests], [len(d) for d in found], [g is not None for g in guesses]
        )
        return [d[:k] for d, k in zip(found, depths, strict=True)], guesses

    def _drain(self) -> None:
        """Read the step in flight, if any."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self._read(inflight)

    def _read(self, step: _InFlight) -> None:
        """Wait for an async-scheduled step's tokens and emit them (to the outbox, which goes to the
        streams before the engine's next wait). A row that left meanwhile (finished in the step
        before, or cancelled) drops its tokens. A row that drafted keeps the drafts it accepted:
        its target state drops the others, and the step queued after it, which the device moved
        back already (`spec_step.queue`'s shift), is where the host now puts it too."""
        self._deliver()  # the GPU has the next step queued: the streams take the GIL while the host waits
        emitted = step.queued.host()
        after = self._inflight
        following = {} if after is None else {r: i for i, r in enumerate(after.requests)}
        for request, tokens, slot, proposal in zip(
            step.requests, emitted, step.queued.slots, step.queued.proposals, strict=True
        ):
            if request.cancelled.is_set():
                continue
            seq = request.seq
            state = seq.target_state
            state.tokens[slot] = seq.history[-1]  # what the step fed: read by now
            drafts = proposal.token_ids
            rejected = len(drafts) - (len(tokens) - 1)
            if rejected:
                del state.tokens[slot + 1 + len(tokens) - 1 : slot + 1 + len(drafts)]
                state.kv.length -= rejected
                if request in following:
                    after.queued.slots[following[request]] -= rejected
            misguessed = request in self._misguessed
            self._misguessed.discard(request)
            if request in following:  # the drafts queued after this step assumed it ended so
                ahead = after.guesses[following[request]]
                if ahead is not None:
                    right = ahead.accepted == len(tokens) - 1 and ahead.token == tokens[-1]
                    self.policy.guessed(seq, right)
                    if not right:
                        self._misguessed.add(request)
            if seq.k:
                self._chose(seq, len(drafts))
                if drafts:  # verified drafts count, whatever context they continued
                    self._record(seq, proposal, spec_step.Verified(tokens, list(range(len(tokens) - 1)), False, []))
                if drafts and not misguessed:
                    self.policy.verified(seq, LOOKUP, len(drafts), len(tokens) - 1)
                else:  # a K = 0 row (no match, or the batch gate), or drafts whose guess failed: no
                    self.policy.ran_plain(seq)  # observation of what prompt lookup proposes
            self._advance(request, tokens, [])

    def _chose(self, seq: Sequence, depth: int) -> None:
        seq.stats.chosen_k[depth] += 1
        if self.metrics:
            self.metrics.record_chosen(self.proposer.method, depth)

    def _advance(self, request: Request, emitted: list[int], logprobs: list[TokenLogprob]) -> None:
        seq = request.seq
        out, reason = seq.append(emitted)
        logprobs = logprobs[: len(out)]
        if reason:
            self._finish(request, out, reason, logprobs)
        else:
            self.policy.advanced(seq)
            self._emit(request, Event(out, logprobs=logprobs))

    def _finish(
        self, request: Request, tokens: list[int], reason: str, logprobs: list[TokenLogprob] | None = None
    ) -> None:
        stats = request.seq.stats
        self._emit(request, Event(tokens, finished=True, finish_reason=reason, stats=stats, logprobs=logprobs or []))
        request.cancelled.set()  # leaves the batch

    def _record(self, seq: Sequence, proposal: Proposal, row: spec_step.Verified) -> None:
        if not proposal.token_ids:
            return  # K = 0 verifies nothing
        ranks = seq.stats.record(proposal, row.path)
        if self.metrics:
            nodes, emitted = len(proposal.token_ids), len(row.emitted)
            self.metrics.record_step(row.do_sample, nodes, emitted - 1, emitted, ranks)
            if proposal.source != PREFILL:
                self.metrics.record_source(proposal.source, nodes, emitted - 1)
