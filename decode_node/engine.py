"""The decode engine: a continuous-batching scheduler over sequences, no gRPC inside.

Each request arrives validated (`protos.validation.DecodeInput`) and becomes a `Sequence`
(engine/sequence.py: prompt + the prefill's first token, budget, stop rule, K, generator,
the proposal it came with). Its KV came in the message or arrives after it (DecodeStream,
shared memory): such a request's target KV is reserved in arrival order, the servicer writes
the bytes straight into it, and the request is admitted once they are all in. Each engine
step admits what fits (slots and KV blocks), then runs one step for every active sequence:
the speculative step of engine/spec_step.py (propose up to the K each sequence's running
acceptance pays for, engine/adaptive.py; verify in one target forward and one
rejection-sampling launch; keep the accepted path), or, with async scheduling, a queued K = 0
step. Emitted tokens go to the request's event queue; the servicer streams them.

Async scheduling (`DecodeConfig.async_scheduling`; on a GPU by default): a step whose rows all
decode without speculation (K = 0, no logprobs) is queued on the device before the step
before it is read. Its input tokens are that step's sampled tokens, still on the device; its
positions and KV slots are known without them (every row gains exactly one token). So the
host builds step n+1 while the GPU runs step n, and reads step n only then. A row that
finished in step n (end of sequence, a stop token, a cancel) also ran in step n+1: that token
is dropped, and its KV is freed once step n+1 is read. A speculating step waits for the step
before it (`_drain`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from common.transfer import Buffer, HostCopy, to_device, to_host_async
from engine import spec_step
from engine.adaptive import AdaptiveK, BatchGate, StepCosts, calibrate
from engine.device import on_device
from engine.options import SPECULATIVE_METHODS
from engine.prompt_lookup import check_lookup_range
from engine.proposer import Plan, Proposer, check_tree_limits
from engine.sequence import Sequence, Stats
from models.base import import_tensors
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics
from protos.validation import DecodeInput
from sampling import RequestRng, Verifier, VerifyBatch
from sampling.logprobs import TokenLogprob
from sampling.proposal import DRAFT, LOOKUP, PREFILL, DraftLaw, Proposal
from sampling.tree import MAX_TREE_NODES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    max_speculative_tokens: int = 8
    max_draft_candidates: int = 4  # candidates per node a request may ask for (1: chains only)
    max_tree_nodes: int = MAX_TREE_NODES  # nodes of one proposal tree at most
    max_batch: int = 32  # requests per engine step
    max_queue: int = 128  # requests waiting for a batch slot; beyond that: QueueFull
    draft_law: DraftLaw = DraftLaw.POINT_MASS
    default_max_new_tokens: int = 64
    sampler_backend: str = "auto"
    device: str = "cpu"
    async_scheduling: str = "auto"  # on | off | auto (on where the device is a GPU)
    speculative_method: str = "draft"  # engine/options.SPECULATIVE_METHODS
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive_k: str = "auto"  # on | off | auto (on for prompt-lookup and hybrid)
    step_costs: StepCosts | None = None  # adaptive K's cost table; None: measured at start-up (calibrate)

    def __post_init__(self) -> None:
        check_tree_limits(self.max_draft_candidates, self.max_tree_nodes)
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise ValueError(f"async_scheduling: expected one of {ASYNC_SCHEDULING}, got {self.async_scheduling!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method: expected one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}"
            )
        check_lookup_range(self.prompt_lookup_min, self.prompt_lookup_max)
        if self.adaptive_k not in ADAPTIVE_K:
            raise ValueError(f"adaptive_k: expected one of {ADAPTIVE_K}, got {self.adaptive_k!r}")

    @property
    def adaptive(self) -> bool:
        """Whether each step picks each request's K (else every step drafts the request's K)."""
        if self.adaptive_k == "auto":
            return self.speculative_method != DRAFT
        return self.adaptive_k == "on"

    @property
    def pipelined(self) -> bool:
        """Whether K = 0 steps are queued before the step before them is read."""
        if self.async_scheduling == "auto":
            return torch.device(self.device).type == "cuda"
        return self.async_scheduling == "on"


ASYNC_SCHEDULING = ("auto", "on", "off")
ADAPTIVE_K = ("auto", "on", "off")


class QueueFull(Exception):
    """The engine holds max_batch + max_queue requests already."""


@dataclass(frozen=True)
class Event:
    tokens: list[int]
    finished: bool = False
    finish_reason: str = ""
    stats: Stats | None = None
    error: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for


@dataclass(eq=False)
class Request:
    """One in-flight request: the servicer's handle (it reads `events` and may call
    engine.cancel) on the engine's sequence."""

    input: DecodeInput
    seq: Sequence
    kv_need: int  # KV positions it may ever occupy, reserved at admission: it never waits mid-stream
    # one put per request per step, by the engine thread: SimpleQueue's is C, with no Condition to notify
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    # Streamed: the KV is not in `input`; the servicer writes it into seq.target_state once
    # `reserved` is set (DecodeEngine.import_chunk), then calls DecodeEngine.imported.
    streamed: bool = False
    reserved: threading.Event = field(default_factory=threading.Event)
    imported: bool = False


@dataclass
class _InFlight:
    """An async-scheduled step queued on the device, not yet read."""

    requests: list[Request]
    tokens: torch.Tensor  # [B] int64 on the device: each row's sampled token, the next step's input
    copy: HostCopy  # the same tokens on their way to the host
    slots: list[int]  # where each row's fed token sits in its target state's tokens (UNREAD until read)


UNREAD = -1  # a target state's token whose value is still on the device (async scheduling)


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
        self.proposer = proposer or Proposer.for_node(pair, config)
        self.costs = config.step_costs or StepCosts((1.0,) * (config.max_speculative_tokens + 1))
        # Prompt lookup with adaptive K: whether a batch speculates at all, from its measured steps.
        self.gate = BatchGate() if config.adaptive and self.proposer.method == LOOKUP else None
        self._step_kind: tuple[int, bool] | None = None  # (rows, speculated) of a gated step, for the gate
        self._lock = threading.Condition()
        self._pending: list[Request] = []
        self._active: list[Request] = []
        self._outbox: list[tuple[Request, Event]] = []  # events made, not yet handed to their streams (step)
        self._inflight: _InFlight | None = None  # async scheduling: the step queued and not yet read
        self._running = False
        self._thread: threading.Thread | None = None

    # -- requests -------------------------------------------------------------------
    def sequence(self, decode_input: DecodeInput) -> Sequence:
        """A request's sequence, every default resolved: prompt + the prefill node's first token,
        the budget, the stop rule, its K and candidates, its generator and what it drafts with."""
        config, k = self.config, decode_input.num_speculative_tokens
        return Sequence(
            prompt=decode_input.prompt_token_ids,
            params=decode_input.params,
            budget=decode_input.max_new_tokens or config.default_max_new_tokens,
            eos_token_ids=tuple(self.pair.target.eos_token_ids),
            stop_token_ids=tuple(decode_input.stop_token_ids),
            rng=RequestRng(decode_input.params.seed, stream="decode"),
            k=k,
            candidates=decode_input.draft_candidates,
            logprobs=decode_input.logprobs,
            method=config.speculative_method,
            history=[*decode_input.prompt_token_ids, decode_input.first_token_id],
            spec=AdaptiveK(k) if config.adaptive and k else None,
            received=decode_input.proposal,  # its law is moved to the device when verified
        )

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
        self.pair.target.import_chunk(request.seq.target_state, index, offset, data)

    def imported(self, request: Request) -> None:
        """Every KV byte of a streamed request written: it is admitted when a slot is free."""
        self.pair.target.finish_import(request.seq.target_state)
        with self._lock:
            request.imported = True
            self._lock.notify()

    def _kv_models(self) -> list[tuple[str, object]]:
        """The models that hold KV for a request (no draft KV where only prompt lookup drafts)."""
        models = [("target", self.pair.target)]
        return [*models, ("draft", self.pair.draft)] if self.proposer.uses_draft else models

    @property
    def max_draft_candidates(self) -> int:
        """Candidates per node this node verifies and drafts: 1 where a model cannot mask by tree."""
        return self.config.max_draft_candidates if self.proposer.trees else 1

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
        """Measure adaptive K's cost table on this node's models (`engine/adaptive.calibrate`), as
        this node runs a K = 0 step (queued, with async scheduling). Start-up only (the engine
        thread is not running); a no-op without adaptive K or with a table configured."""
        config = self.config
        if not config.adaptive or config.step_costs is not None:
            return self.costs
        draft = self.pair.draft if self.proposer.uses_draft else None
        with on_device(config.device):
            self.costs = calibrate(
                self.pair.target, draft, self.verifier, config.max_speculative_tokens, self.pipelined
            )
        log.info(
            "adaptive K step costs: verify %s, draft depth %.2f, K = 0 read back %.2f",
            self.costs.verify,
            self.costs.depth,
            self.costs.sync,
        )
        return self.costs

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
        speculative step for every active one. Every request that leaves frees its KV.

        deliver=False (the engine's own loop): the step's events stay in the outbox until the
        next step has queued its GPU work (`_deliver` before its host read), or until no request
        is running. The stream threads woken by them then run while this thread waits for the
        GPU, not while it prepares the next step: on an H200 at 32 streams they took the GIL
        ~1.8 ms per step, on the engine's critical path."""
        started = time.perf_counter()
        self._step_kind = None
        with on_device(self.config.device):
            ran = self._step()
        if self._step_kind is not None:
            rows, speculated = self._step_kind
            self.gate.record(rows, speculated, time.perf_counter() - started)
        if deliver or not self._active:
            self._deliver()
        if ran and self.metrics:
            self.metrics.engine_step.labels("decode").observe(time.perf_counter() - started)

    def _emit(self, request: Request, event: Event) -> None:
        self._outbox.append((request, event))

    def _deliver(self) -> None:
        """Hand the outbox's events to their streams, in the order they were made."""
        outbox, self._outbox = self._outbox, []
        for request, event in outbox:
            request.events.put(event)

    def _step(self) -> bool:
        """One step; False when no request was running (nothing was timed)."""
        admitted = []
        with self._lock:
            room = self.config.max_batch - len(self._active)
            for request in list(self._pending):
                # A streamed request takes its KV before it takes a slot: its upload runs while it waits.
                if (len(admitted) >= room and not request.streamed) or not self._claim(request):
                    break  # what is behind it waits its turn
                if len(admitted) < room and (request.imported or not request.streamed):
                    self._pending.remove(request)
                    admitted.append(request)
            if not admitted and not self._active:
                self._lock.wait(0.01)  # nothing can start now (no slot or KV): do not spin
        for request in admitted:
            try:
                self._admit(request)
            except Exception as err:
                log.exception("admission failed")
                self._emit(request, Event([], finished=True, error=f"admission failed: {err}"))
                request.cancelled.set()
        self._active += admitted
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
            live.append(request)
        if not live and inflight is None:
            self._sweep()
            return False
        try:
            hold = bool(live) and self._gated(live, unread, self._pipelines(live, unread))
            if hold and self.pipelined:
                self._launch(live)
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
        seq.target_state = self.pair.target.begin_import(seq.prompt, request.kv_need)
        request.reserved.set()
        return True

    def _retire(self, request: Request) -> None:
        """Free a leaving request's KV (finished, cancelled, expired or failed)."""
        seq = request.seq
        for model, state in ((self.pair.target, seq.target_state), (self.pair.draft, seq.draft_state)):
            if state is not None:
                model.release(state)
        seq.target_state = seq.draft_state = None

    # -- internals --------------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        """Its KV into the blocks `_claim` reserved (unless streamed there already), and the
        draft state and prompt-lookup index of a request that speculates."""
        if request.cancelled.is_set():
            return  # never starts: _retire frees what _claim reserved
        seq, data = request.seq, request.input
        if not request.streamed:
            import_tensors(self.pair.target, seq.target_state, data.kv_cache)
        if seq.k and self.proposer.uses_draft:  # a request that never drafts needs no draft state
            seq.draft_state = self.pair.draft.prefill(seq.prompt)[1]
            self.pair.draft.reserve(seq.draft_state, request.kv_need)
        if seq.k:
            self.proposer.index(seq)
        if self.metrics:
            self.metrics.queue_time.labels("decode").observe(time.monotonic() - request.arrived)
            self.metrics.prompt_tokens.labels("decode").inc(len(seq.prompt))

    def _speculate(self, requests: list[Request], hold: bool) -> None:
        """A synchronous step (engine/spec_step.py): each row proposes the K its running
        acceptance pays for (adaptive K) or its own K, or verifies what it received on its first
        step; nothing is drafted when the batch gate holds the step (`hold`)."""
        seqs = [r.seq for r in requests]
        own = [s for s in seqs if not s.first_step and s.k]
        caps = [0 if hold or self._lookup_idle(s) else s.k for s in own]
        chosen: dict[Sequence, tuple[Plan, int]] = {}
        for seq, plan in zip(own, self.proposer.plan(own, caps), strict=True):
            depth = plan.limit if seq.spec is None else seq.spec.choose(plan.source, plan.limit, self.costs)
            chosen[seq] = plan, depth
            self._chose(seq, depth)
        plans = [chosen[s][0] if s in chosen else None for s in seqs]
        depths = [chosen[s][1] if s in chosen else 0 for s in seqs]
        proposals = spec_step.propose(self.proposer, seqs, plans, depths, self.config.device, hold)
        verified = spec_step.verify(self.pair.target, self.pair.draft, self.verifier, seqs, proposals, self._deliver)
        for request, proposal, row in zip(requests, proposals, verified, strict=True):
            seq = request.seq
            self._record(seq, proposal, row)
            if seq.spec is not None:
                ours = proposal.source != PREFILL  # the prefill's proposal says nothing of this node's choices
                seq.spec.observe(proposal.source if ours else None, proposal.depth, len(row.emitted) - 1)
            self._advance(request, row.emitted, row.logprobs)

    def _pipelines(self, requests: list[Request], unread: set[Request]) -> bool:
        """Whether this step can be queued before the step in flight (its rows: `unread`) is
        read: every row emits exactly one token (no drafts: K = 0, or prompt lookup that may not
        draft now) and needs nothing but its token back (no logprobs)."""
        if not self.pipelined:
            return False
        return all(r.seq.plain or self._lookup_idle(r.seq, r in unread) for r in requests)

    def _gated(self, requests: list[Request], unread: set[Request], pipelines: bool) -> bool:
        """Whether this step runs at K = 0 (queued, with async scheduling): when every row emits
        one token anyway (`pipelines`), or when the batch gate holds it there. Only a batch of more
        than one row with nothing to read back but their tokens is gated; its step is then timed
        for the gate, of either kind. A row's tokens never depend on the gate's choice: prompt
        lookup proposes point masses, verified by coupling (seeded sampled rows draw what they
        would at K = 0). A row on its first step is held by dropping the prefill's proposal (a
        point mass too): else every request that joins a large batch would make one step of the
        whole batch speculate."""
        seqs = [r.seq for r in requests]
        gateable = (
            self.gate is not None
            and len(seqs) > 1
            and all(
                (s.plain or s.spec is not None) and not s.logprobs and (not s.first_step or s.received.probs is None)
                for s in seqs
            )
        )
        if not gateable:
            return pipelines
        expected = sum(self._gain(r.seq, r in unread) for r in requests)
        plain = pipelines or not self.gate.allows(len(seqs), expected)
        self._step_kind = (len(seqs), not plain)
        return plain

    def _gain(self, seq: Sequence, in_flight: bool) -> float:
        """The tokens a row expects from this step if the batch speculates."""
        if seq.plain:
            return 1.0
        if seq.first_step:  # the prefill's proposal, at the acceptance the row has shown (its prior)
            return seq.spec.expected(LOOKUP, len(seq.received.token_ids))
        return 1.0 if self._lookup_idle(seq, in_flight) else seq.gain

    def _lookup_idle(self, seq: Sequence, in_flight: bool = False) -> bool:
        """A prompt-lookup row whose next step cannot draft, past its first step. The context after
        the step before the last decides: `hit` while the row's last step is still in flight,
        `may_draft` once it is read."""
        return (
            self.proposer.method == LOOKUP
            and seq.lookup is not None
            and not (seq.hit if in_flight else seq.may_draft)
            and not seq.first_step
            and not seq.logprobs
        )

    def _lookup_hit(self, seq: Sequence) -> bool:
        """Whether the context as it is now has a prompt-lookup match that adaptive K would draft,
        and, with async scheduling, one worth the wait for the token in flight (`pays_to_wait`)."""
        matched, _ = seq.lookup.match(seq.k)
        if seq.spec is None:
            return bool(matched)
        k = seq.spec.choose(LOOKUP, len(matched), self.costs) if matched else 0
        seq.gain = seq.spec.expected(LOOKUP, k)
        return k > 0 and (not self.pipelined or seq.spec.pays_to_wait(LOOKUP, k, self.costs))

    def _launch(self, requests: list[Request]) -> None:
        """Queue a K = 0 step for `requests` (async scheduling), then read the step before it.
        A row that was in that step feeds its token from the device; a row new to the batch
        feeds its last history token."""
        previous = self._inflight
        carried = {} if previous is None else {r: i for i, r in enumerate(previous.requests)}
        index, fresh = [], []  # row -> its token in cat(the previous step's tokens, the fresh rows' last tokens)
        for request in requests:
            if request in carried:
                index.append(carried[request])
            else:
                index.append(len(carried) + len(fresh))
                fresh.append(request)
        packed = torch.tensor([*index, *(r.seq.history[-1] for r in fresh)], dtype=torch.int64)  # one copy for both
        packed = to_device(packed, self.config.device)
        earlier = previous.tokens if previous is not None else packed[:0]
        tokens = torch.cat([earlier, packed[len(requests) :]])[packed[: len(requests)]]  # [B] int64
        seqs = [r.seq for r in requests]
        for seq in seqs:
            seq.received = None  # a first step held at K = 0 drops what it received
        states = [s.target_state for s in seqs]
        logits = self.pair.target.extend_batch(states, [[UNREAD]] * len(seqs), device_tokens=tokens)  # no tree
        slots = [len(state.tokens) - 1 for state in states]
        no_drafts = torch.empty(len(seqs), 0, dtype=torch.int64)
        positions = [len(r.seq.history) + (r in carried) for r in requests]  # a carried row's token is still unread
        result = self.verifier.verify(
            VerifyBatch(no_drafts, positions=positions),
            torch.stack(logits).to(self.verifier.device),
            [s.params for s in seqs],
            [s.rng for s in seqs],
        )
        sampled = result.output_token_ids[:, 0].to(torch.int64)  # [B]: K = 0 emits one token per row
        # its own stream: not behind a KV export's copies (a prefill node in the same process)
        self._inflight = _InFlight(requests, sampled, to_host_async(sampled, purpose="tokens"), slots)
        if previous is None:
            self._deliver()  # queued, and no step before to wait for: the streams run now
        else:
            self._read(previous)  # which delivers before it waits

    def _drain(self) -> None:
        """Read the step in flight, if any."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self._read(inflight)

    def _read(self, step: _InFlight) -> None:
        """Wait for an async-scheduled step's tokens and emit them (to the outbox, which goes to the
        streams before the engine's next wait). A row that left meanwhile (finished in the step
        before, or cancelled) drops its token."""
        self._deliver()  # the GPU has the next step queued: the streams take the GIL while the host waits
        tokens = step.copy.wait().tolist()
        for request, token, slot in zip(step.requests, tokens, step.slots, strict=True):
            if request.cancelled.is_set():
                continue
            seq = request.seq
            seq.target_state.tokens[slot] = seq.history[-1]  # what the step fed: read by now
            if seq.lookup is not None:  # a prompt-lookup row that could not draft
                self._chose(seq, 0)
                if seq.spec is not None:
                    seq.spec.observe(None, 0, 0)
            self._advance(request, [token], [])

    def _chose(self, seq: Sequence, depth: int) -> None:
        seq.stats.chosen_k[depth] += 1
        if self.metrics:
            self.metrics.chosen_k.labels(self.proposer.method).observe(depth)

    def _advance(self, request: Request, emitted: list[int], logprobs: list[TokenLogprob]) -> None:
        seq = request.seq
        out, reason = seq.append(emitted)
        logprobs = logprobs[: len(out)]
        if seq.lookup is not None and not reason:
            seq.may_draft, seq.hit = seq.hit, self._lookup_hit(seq)
        if reason:
            self._finish(request, out, reason, logprobs)
        else:
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
