"""The decode engine: continuous batching of speculative decoding, no gRPC inside.

Each request arrives validated (`protos.validation.DecodeInput`): prompt, first token,
the prefill's K proposals and the KV state, or, streamed (DecodeStream, shared memory), the
KV after it: such a request's target KV is reserved in arrival order, the servicer writes the
bytes straight into it, and the request is admitted once they are all in. Every engine step,
for all active requests at once: the draft proposes K tokens (except on a request's first
step, which verifies the prefill's proposal), one batched target call scores [last,
d1..dK], and one verifier call per (K, draft-law) group runs rejection sampling. Emitted
tokens go to the request's event queue; the servicer streams them.

Token bookkeeping per request: `history` = prompt + every emitted token. The target
has consumed all of history but its last token; the draft has consumed a prefix of
history and catches up before it proposes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.proposer import draft_tokens
from models.base import State, import_tensors
from models.kv_import import Buffer
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics
from pdspec.stopping import finish_reason
from protos.validation import DecodeInput
from sampling import RequestRng, SamplingTensors, Verifier
from sampling.logprobs import TokenLogprob, token_logprobs
from sampling.proposal import DraftLaw

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    max_speculative_tokens: int = 8
    max_batch: int = 32  # requests per engine step
    max_queue: int = 128  # requests waiting for a batch slot; beyond that: QueueFull
    draft_law: DraftLaw = DraftLaw.POINT_MASS
    default_max_new_tokens: int = 64
    sampler_backend: str = "auto"
    device: str = "cpu"


class QueueFull(Exception):
    """The engine holds max_batch + max_queue requests already."""


@dataclass
class Stats:
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0  # accepted DRAFT tokens
    accepted_per_position: list[int] = field(default_factory=list)


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
    """One in-flight request; the servicer reads `events` and may call engine.cancel."""

    input: DecodeInput
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    # Streamed: the KV is not in `input`; the servicer writes it into target_state once
    # `reserved` is set (DecodeEngine.import_chunk), then calls DecodeEngine.imported.
    streamed: bool = False
    reserved: threading.Event = field(default_factory=threading.Event)
    imported: bool = False
    # Engine-owned from here on.
    history: list[int] = field(default_factory=list)
    target_state: State | None = None
    draft_state: State | None = None
    rng: RequestRng | None = None
    remaining: int = 0  # tokens this node may still emit
    first_step: bool = True
    stats: Stats = field(default_factory=Stats)


@dataclass
class _Proposal:
    draft_ids: list[int]  # target ids
    probs: torch.Tensor | None  # [K, Vt] target space, None = point mass


class DecodeEngine:
    def __init__(
        self,
        pair: ModelPair,
        config: DecodeConfig,
        metrics: NodeMetrics | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.pair = pair
        self.config = config
        self.metrics = metrics
        self.verifier = verifier or Verifier(config.sampler_backend, config.device)
        self.d2t = pair.d2t.to(config.device)
        self._lock = threading.Condition()
        self._pending: list[Request] = []
        self._active: list[Request] = []
        self._running = False
        self._thread: threading.Thread | None = None

    # -- requests -------------------------------------------------------------------
    def kv_tokens(self, decode_input: DecodeInput) -> int:
        """KV positions a request may ever occupy: prompt + every token it may emit + the K
        drafts of its last verify pass (reserved at admission, so it never waits mid-stream)."""
        budget = decode_input.max_new_tokens or self.config.default_max_new_tokens
        return len(decode_input.prompt_token_ids) + budget + self.config.max_speculative_tokens + 1

    def submit(self, decode_input: DecodeInput, *, streamed: bool = False) -> Request:
        """Queue a request (QueueFull when it can never fit or the queue is full). `streamed`: its
        KV comes later; its target KV is reserved when its turn comes (at once when nothing waits
        ahead of it), `request.reserved` is set, and the caller writes the bytes (import_chunk)
        and calls imported(), or cancel()."""
        request = Request(decode_input, streamed=streamed)
        needed = self.kv_tokens(decode_input)
        for role, model in (("target", self.pair.target), ("draft", self.pair.draft)):
            capacity = model.capacity_tokens()
            if capacity is not None and needed > capacity:
                raise QueueFull(f"the request needs {needed} KV positions, the {role} KV cache holds {capacity}")
        with self._lock:
            if len(self._pending) + len(self._active) >= self.config.max_batch + self.config.max_queue:
                raise QueueFull(f"{self.config.max_batch} running and {self.config.max_queue} queued")
            if streamed and all(r.target_state is not None for r in self._pending):
                self._claim(request)  # nothing waits for KV ahead of it: the upload need not wait for a step
            self._pending.append(request)
            self._lock.notify()
        return request

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
        self.pair.target.import_chunk(request.target_state, index, offset, data)

    def imported(self, request: Request) -> None:
        """Every KV byte of a streamed request written: it is admitted when a slot is free."""
        self.pair.target.finish_import(request.target_state)
        with self._lock:
            request.imported = True
            self._lock.notify()

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
                    return
            self.step()

    def step(self) -> None:
        """Admit waiting requests (in arrival order, while slots and KV blocks last), then one
        speculative step for every active one. Every request that leaves frees its KV."""
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
                request.events.put(Event([], finished=True, error=f"admission failed: {err}"))
                request.cancelled.set()
        live = []
        for request in self._active + admitted:
            if request.cancelled.is_set():
                self._retire(request)
                continue
            if request.remaining <= 0:
                self._finish(request, [], "length")
                self._retire(request)
                continue
            live.append(request)
        self._active = live
        if not live:
            return
        try:
            self._speculate(live)
        except Exception as err:  # a bug must not take the node down: fail these requests
            log.exception("decode step failed")
            for request in live:
                request.events.put(Event([], finished=True, error=f"decode step failed: {err}"))
                request.cancelled.set()
        kept = []
        for request in self._active:
            (self._retire if request.cancelled.is_set() else kept.append)(request)
        self._active = kept

    def _claim(self, request: Request) -> bool:
        """Reserve the request's target KV for all it may need (`kv_tokens`); False when the pools
        cannot hold it now. Called with the lock held, by the engine thread and by submit for an
        upload, so no thread takes blocks between another's check and its reservation. The draft
        KV is reserved at admission: its pool holds as many tokens as the target's, and a request
        holds draft blocks only while it holds target blocks, so it fits then."""
        if request.target_state is not None or request.cancelled.is_set():
            return True  # reserved already, or admitted only to be retired at once
        needed = self.kv_tokens(request.input)
        if not (self.pair.target.can_reserve(needed) and self.pair.draft.can_reserve(needed)):
            return False
        request.target_state = self.pair.target.begin_import(request.input.prompt_token_ids, needed)
        request.reserved.set()
        return True

    def _retire(self, request: Request) -> None:
        """Free a leaving request's KV (finished, cancelled, expired or failed)."""
        for model, state in ((self.pair.target, request.target_state), (self.pair.draft, request.draft_state)):
            if state is not None:
                model.release(state)
        request.target_state = request.draft_state = None

    # -- internals --------------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        data = request.input
        pair = self.pair
        request.history = [*data.prompt_token_ids, data.first_token_id]
        if request.cancelled.is_set():
            return  # never starts: _retire frees what _claim reserved
        needed = self.kv_tokens(data)
        if not request.streamed:  # the KV came in the message: into the blocks _claim reserved
            import_tensors(pair.target, request.target_state, data.kv_cache)
        request.draft_state = pair.draft.prefill(data.prompt_token_ids)[1]
        pair.draft.reserve(request.draft_state, needed)
        request.rng = RequestRng(data.params.seed, stream="decode")
        budget = data.max_new_tokens or self.config.default_max_new_tokens
        request.remaining = budget - 1  # the prefill node emitted the first token
        request.stats.accepted_per_position = [0] * data.num_speculative_tokens
        if self.metrics:
            self.metrics.queue_time.labels("decode").observe(time.monotonic() - request.arrived)
            self.metrics.prompt_tokens.labels("decode").inc(len(data.prompt_token_ids))

    def _speculate(self, requests: list[Request]) -> None:
        proposals = self._proposals(requests)
        old_len = {id(r): len(r.history) for r in requests}
        feeds = [[r.history[-1], *p.draft_ids] for r, p in zip(requests, proposals, strict=True)]
        logits = self.pair.target.extend_batch([r.target_state for r in requests], feeds)
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, p in enumerate(proposals):
            groups.setdefault((len(p.draft_ids), p.probs is None), []).append(i)
        for (k, point_mass), rows in groups.items():
            batch = [requests[i] for i in rows]
            draft_ids = torch.tensor([proposals[i].draft_ids for i in rows], dtype=torch.int64).view(len(rows), k)
            probs = None if point_mass else torch.stack([proposals[i].probs for i in rows])
            target_logits = torch.stack([logits[i] for i in rows]).to(self.verifier.device)  # [R, K+1, Vt]
            result = self.verifier.verify(
                draft_ids, probs, target_logits, [r.input.params for r in batch], [r.rng for r in batch]
            )
            do_sample = result.stats.do_sample.cpu().tolist()
            for row, (request, emitted) in enumerate(zip(batch, result.emitted_rows(), strict=True)):
                self._record(request, k, len(emitted), do_sample[row])
                top = request.input.logprobs
                logprobs = token_logprobs(target_logits[row, : len(emitted)], torch.tensor(emitted), top) if top else []
                self._advance(request, emitted, old_len[id(request)], logprobs)

    def _proposals(self, requests: list[Request]) -> list[_Proposal]:
        """The prefill's proposal on a request's first step; else K drafts from the local draft."""
        out: list[_Proposal | None] = [None] * len(requests)
        local = []
        for i, request in enumerate(requests):
            if request.first_step:
                request.first_step = False
                data = request.input
                probs = None if data.draft_probs is None else data.draft_probs.to(self.config.device)
                out[i] = _Proposal(data.draft_token_ids.tolist(), probs)
            elif request.input.num_speculative_tokens:
                local.append(i)
            else:
                out[i] = _Proposal([], None)
        if local:
            for i, proposal in zip(local, self._draft([requests[i] for i in local]), strict=True):
                out[i] = proposal
        return out

    def _draft(self, requests: list[Request]) -> list[_Proposal]:
        """K drafts per request from the local draft (engine/proposer.py), in target space."""
        ks = [r.input.num_speculative_tokens for r in requests]
        device = self.config.device
        uniforms = torch.stack(
            [torch.nn.functional.pad(r.rng.uniforms(k), (0, max(ks) - k)) for r, k in zip(requests, ks, strict=True)]
        ).to(device)  # [R, K_max]: each request's K uniforms, zero padded
        drafted = draft_tokens(
            self.pair.draft,
            self.d2t,
            self.config.draft_law,
            [r.draft_state for r in requests],
            [r.history[len(r.draft_state.tokens) :] for r in requests],  # catch up, ends with `last`
            ks,
            SamplingTensors.from_params([r.input.params for r in requests], device),
            uniforms,
        )
        return [_Proposal(d.target_ids, None if d.probs is None else self.d2t.map_probs(d.probs)) for d in drafted]

    def _advance(self, request: Request, emitted: Sequence[int], old_len: int, logprobs: list[TokenLogprob]) -> None:
        accepted = len(emitted) - 1
        self.pair.target.truncate(request.target_state, old_len + accepted)
        draft_state = request.draft_state
        self.pair.draft.truncate(draft_state, min(len(draft_state.tokens), old_len + accepted))
        data = request.input
        budget = data.max_new_tokens or self.config.default_max_new_tokens
        done = budget - request.remaining  # tokens of this request emitted so far (prefill's first included)
        out, reason = [], ""
        for token in emitted:
            out.append(token)
            reason = finish_reason(token, self.pair.target.eos_token_ids, data.stop_token_ids, done + len(out), budget)
            if reason:
                break
        request.history += out
        request.remaining -= len(out)
        logprobs = logprobs[: len(out)]
        if reason:
            self._finish(request, out, reason, logprobs)
        else:
            request.events.put(Event(out, logprobs=logprobs))

    def _finish(
        self, request: Request, tokens: list[int], reason: str, logprobs: list[TokenLogprob] | None = None
    ) -> None:
        request.events.put(
            Event(tokens, finished=True, finish_reason=reason, stats=request.stats, logprobs=logprobs or [])
        )
        request.cancelled.set()  # leaves the batch

    def _record(self, request: Request, k: int, emitted: int, do_sample: bool) -> None:
        if k == 0:
            return  # K = 0 verifies nothing
        stats = request.stats
        stats.verify_steps += 1
        stats.draft_tokens += k
        stats.accepted_tokens += emitted - 1
        for position in range(emitted - 1):
            stats.accepted_per_position[position] += 1
        if self.metrics:
            self.metrics.record_step(do_sample, k, emitted - 1, emitted)
