"""The decode engine: continuous batching of speculative decoding, no gRPC inside.

Each request arrives validated (`protos.validation.DecodeInput`): prompt, first token,
the prefill's K proposals and the KV state. Every engine step, for all active requests
at once: the draft proposes K tokens (except on a request's first step, which verifies
the prefill's proposal), one batched target call scores [last, d1..dK], and one
verifier call per (K, draft-law) group runs rejection sampling. Emitted tokens go to the
request's event queue; the servicer streams them.

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
from models.base import State
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

    def submit(self, decode_input: DecodeInput) -> Request:
        request = Request(decode_input)
        needed = self.kv_tokens(decode_input)
        for role, model in (("target", self.pair.target), ("draft", self.pair.draft)):
            capacity = model.capacity_tokens()
            if capacity is not None and needed > capacity:
                raise QueueFull(f"the request needs {needed} KV positions, the {role} KV cache holds {capacity}")
        with self._lock:
            if len(self._pending) + len(self._active) >= self.config.max_batch + self.config.max_queue:
                raise QueueFull(f"{self.config.max_batch} running and {self.config.max_queue} queued")
            self._pending.append(request)
            self._lock.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Drop a request: a queued one leaves the queue now, a running one at the next step."""
        request.cancelled.set()
        with self._lock:
            if request in self._pending:
                self._pending.remove(request)

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
            while self._pending and len(admitted) < room and self._fits(self._pending[0]):
                admitted.append(self._pending.pop(0))
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

    def _fits(self, request: Request) -> bool:
        if request.cancelled.is_set():
            return True  # admitted only to be retired at once
        needed = self.kv_tokens(request.input)
        return self.pair.target.can_reserve(needed) and self.pair.draft.can_reserve(needed)

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
            return  # never starts: no KV taken
        needed = self.kv_tokens(data)
        request.target_state = pair.target.import_state(data.kv_cache, data.prompt_token_ids)
        pair.target.reserve(request.target_state, needed)
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
