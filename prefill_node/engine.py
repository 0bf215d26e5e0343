"""The prefill engine: prompt -> first token + K proposals + KV state -> DecodeRequest.

No gRPC inside. The first token is drawn from the target's filtered distribution with the
request's own generator (stream "prefill"; the decode node draws from stream "decode" of
the same seed, so the two never replay each other's uniforms). The proposer
(engine/proposer.py) then proposes up to K tokens after prompt + first token: the draft
model in the configured law, with the exact distribution of each (DENSE / POINT_MASS /
SPARSE on the wire), or prompt lookup, a point mass (POINT_MASS, as many tokens as the
prompt's match gives: a `partial` proposal).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
import uuid
from collections import abc
from dataclasses import dataclass, field

import torch

from common.transfer import HostCopy, to_device
from engine.device import on_device
from engine.grammar import GrammarError, Grammars, GrammarState, guide, jump_forward
from engine.proposers import proposer_for
from engine.sequence import Sequence
from engine.spec_config import SpeculativeConfig
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics
from protos import pdspec_pb2
from protos.constraint import Constraint
from protos.proposal import ProposalEncoding, choose_encoding, encode_proposal
from protos.shm_kv import SharedKvSegment
from protos.validation import (
    Code,
    RequestLimits,
    Violation,
    check_ids,
    check_prompt_length,
    check_request_id,
    check_sampling,
    check_structured_output,
)
from protos.wire import WireDecodeRequest, kv_manifest
from sampling import RequestRng, SamplingParams, SamplingTensors, batch_uniforms, sample_target
from sampling.filtering import restrict
from sampling.logprobs import TokenLogprob, token_logprobs
from sampling.proposal import DraftLaw, Proposal

log = logging.getLogger(__name__)


class KvTransport(enum.Enum):
    """How the KV reaches the decode node."""

    GRPC = "grpc"  # in the Decode message, or over DecodeStream (kv_streaming, threshold)
    SHM = "shm"  # a /dev/shm segment on the same host (protos/shm_kv.py; decode needs --accept-shm-kv)


@dataclass(frozen=True)
class PrefillConfig:
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # None: the exact default for the law (POINT_MASS for a point mass, DENSE otherwise)
    proposal_encoding: ProposalEncoding | None = None
    compact_encodings: bool = False  # pick POINT_MASS / SPARSE automatically (smallest exact)
    # KV over the DecodeStream RPC in slices of kv_chunk_bytes: always, or when it is larger
    # than kv_stream_threshold_bytes (else in the one Decode message)
    kv_streaming: bool = False
    kv_stream_threshold_bytes: int = 64 << 20
    kv_chunk_bytes: int = 4 << 20
    # A streamed KV goes layer by layer while the prefill runs (DecodeStream, proposal last)
    kv_layerwise: bool = False
    kv_transport: KvTransport = KvTransport.GRPC
    default_max_new_tokens: int = 64
    max_prefill_tokens: int = 8192  # prompt tokens per prefill step, over all batched requests (chunking)
    limits: RequestLimits = field(default_factory=RequestLimits)
    device: str = "cpu"  # where sampling runs: the models' device

    @property
    def encoding(self) -> ProposalEncoding:
        """The encoding this node ships (reported in GetInfo)."""
        return choose_encoding(self.proposal_encoding, self.spec.draft_law, self.compact_encodings)

    def __post_init__(self) -> None:
        if self.proposal_encoding is ProposalEncoding.POINT_MASS and self.spec.draft_law is not DraftLaw.POINT_MASS:
            raise ValueError(
                "proposal_encoding: expected dense or sparse for a stochastic draft law "
                "(POINT_MASS is exact only for point masses), got point-mass"
            )


@dataclass(frozen=True)
class Checked:
    """A GenerateRequest that passed `check`, with every default resolved."""

    request_id: str  # the client's, or a generated one when it sent none
    ids: list[int]  # the prompt, tokenized
    k: int
    candidates: int  # per draft node (1: a chain)
    max_new_tokens: int
    params: SamplingParams
    sampling: pdspec_pb2.SamplingParams  # as it travels on to the decode node
    constraint: Constraint | None = None  # structured outputs
    grammar: GrammarState | None = None  # the constraint's matcher, compiled by `check`


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    first_logprob: TokenLogprob | None  # when the request asked for logprobs
    finish_reason: str  # "" while the request goes on to the decode node
    wire: WireDecodeRequest | None  # header + payload views; its kv_cache entries are the KV's
    encoding: ProposalEncoding | None
    kv: list[torch.Tensor] = field(default_factory=list)  # the exported KV (the wire's payloads view it)
    shm: SharedKvSegment | None = None  # --kv-transport shm: the KV's segment instead (the caller unlinks it)
    sent_bytes: int = 0  # KV bytes already handed to the caller's sink (layer by layer)
    stream_kv: bool = False  # `kv` goes over DecodeStream after the header (else inline, by handle, or none)

    @property
    def decode_request(self) -> pdspec_pb2.DecodeRequest | None:
        """The whole standard message (payloads copied in): tests and tools."""
        return None if self.wire is None else self.wire.to_message()

    @property
    def kv_bytes(self) -> int:
        shm = sum(self.shm.handle.lengths) if self.shm else 0
        return sum(t.numel() * t.element_size() for t in self.kv) + shm + self.sent_bytes


@dataclass(frozen=True)
class FirstToken:
    """A request's first token, out before its proposal and KV export (`Ticket.first`)."""

    token: int
    logprob: TokenLogprob | None  # when the request asked for logprobs
    finish_reason: str  # "" while the request goes on to the decode node


IDLE_EXIT_S = 5.0  # the engine thread ends after this long without a job (a submit starts it again)


class PrefillEngine:
    def __init__(self, pair: ModelPair, config: PrefillConfig, metrics: NodeMetrics | None = None) -> None:
        self.pair = pair
        self.config = config
        self.metrics = metrics  # the node's: each step's wall time
        self.contract = pair.contract()
        self.fingerprint = self.contract.fingerprint()
        self.max_speculative_tokens = config.spec.max_speculative_tokens  # lowered to the peer's
        self.proposer = proposer_for(pair, config.spec, config.device)
        self.grammars = Grammars.for_pair(pair)  # structured outputs
        self.max_draft_candidates = config.spec.candidates(self.trees)  # lowered to the peer's
        self._lock = threading.Lock()  # one step at a time (the models need not be thread-safe)
        self._jobs_lock = threading.Lock()
        self._jobs: list[_Job] = []
        # The engine thread runs every step: model work stays on one thread whatever thread
        # submitted it, so torch's OpenMP team is that thread's alone (a team per gRPC worker
        # thread that drove a step grew the process's threads with the worker pool). It is
        # started by a submit and ends after IDLE_EXIT_S without jobs.
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._wake = threading.Event()
        self._waiters: list[threading.Event] = []  # what callers wait for (guarded by _jobs_lock)

    @property
    def trees(self) -> bool:
        """Both models mask by tree: requests may ask for candidate trees."""
        return self.proposer.trees

    @property
    def max_tree_nodes(self) -> int:
        return self.proposer.max_tree_nodes

    @max_tree_nodes.setter
    def max_tree_nodes(self, nodes: int) -> None:  # lowered to the decode peer's
        self.proposer.max_tree_nodes = nodes

    def check(self, request: pdspec_pb2.GenerateRequest) -> Checked | list[Violation]:
        """GenerateRequest semantics and server limits, before any model work."""
        found: list[Violation] = []
        limits = self.config.limits
        check_request_id(request.request_id, limits, found)
        has_text, has_ids = bool(request.prompt), bool(request.prompt_token_ids)
        if has_text == has_ids:
            found.append(
                Violation("prompt", "exactly one of prompt / prompt_token_ids", "both" if has_text else "neither")
            )
        vocab = self.pair.target.vocab_size
        ids = list(request.prompt_token_ids)
        if has_text and not has_ids:
            # Text is bounded by the message limit; the ids it becomes are checked like ids.
            ids = self.pair.tokenizer.encode(request.prompt)
            if not ids:
                found.append(Violation("prompt", "text of at least 1 token", "0 tokens"))
        if check_prompt_length(len(ids), limits, found):
            check_ids("prompt_token_ids", ids, vocab, found)
        capacity = self.pair.target.capacity_tokens()
        if capacity is not None and len(ids) > capacity:
            found.append(
                Violation(
                    "prompt_token_ids",
                    f"at most {capacity} tokens (this node's KV cache)",
                    f"{len(ids)} tokens",
                    Code.RESOURCE_EXHAUSTED,
                )
            )
        params = check_sampling(request.sampling, vocab, found, limits)
        if len(request.stop) > limits.max_stop_strings:
            found.append(
                Violation("stop", f"at most {limits.max_stop_strings} strings", f"{len(request.stop)} strings")
            )
        longest = max((len(s) for s in request.stop), default=0)
        if longest > limits.max_stop_string_chars:
            found.append(
                Violation("stop", f"strings of at most {limits.max_stop_string_chars} characters", f"{longest}")
            )
        if request.HasField("num_speculative_tokens"):
            k = request.num_speculative_tokens
        else:
            k = min(self.config.spec.num_speculative_tokens, self.max_speculative_tokens)
        if not 0 <= k <= self.max_speculative_tokens:
            found.append(Violation("num_speculative_tokens", f"0..{self.max_speculative_tokens}", str(k)))
        if request.HasField("draft_candidates"):
            candidates = request.draft_candidates
        else:
            candidates = max(1, min(self.config.spec.draft_candidates, self.max_draft_candidates))
        if not 1 <= candidates <= self.max_draft_candidates:
            found.append(Violation("draft_candidates", f"1..{self.max_draft_candidates}", str(candidates)))
        constraint = check_structured_output(request.structured_output, found)
        if found:
            return found
        grammar = None
        if constraint is not None:
            try:  # on the caller's thread, bounded (engine/grammar.py): never the engine thread's time
                grammar = self.grammars.compile(constraint)
            except GrammarError as err:
                return [Violation(err.field, err.expected, err.message)]
        sampling = pdspec_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_new_tokens = request.sampling.max_new_tokens or self.config.default_max_new_tokens
        return Checked(
            request.request_id or uuid.uuid4().hex,
            ids,
            k,
            candidates,
            sampling.max_new_tokens,
            params,
            sampling,
            constraint,
            grammar,
        )

    def prefill(self, checked: Checked, sink: queue.Queue | None = None) -> Prefilled:
        """Run a checked request up to the DecodeRequest (or to its end). `sink` (see
        `layerwise`): the KV goes there as it is computed, as (tensor index, HostCopy), then
        the proposal (the returned `wire`, first_token_id and proposal only), or None when
        the request ends at its first token or fails: protos.wire.layered_chunks reads it."""
        return self.prefill_many([checked], [sink])[0]

    def layerwise(self, checked: Checked) -> bool:
        """Whether this request's KV is sent as it is computed (`prefill(sink=)`): a streamed
        KV (kv_streaming or over the threshold) over gRPC, with --kv-layerwise."""
        config, size = self.config, self.contract.kv_bytes(len(checked.ids))
        return config.kv_layerwise and config.kv_transport is KvTransport.GRPC and size > 0 and self.streams(size)

    def stream_header(self, checked: Checked) -> tuple[WireDecodeRequest, list[pdspec_pb2.TensorPB]]:
        """The first DecodeStream chunk of a layer-by-layer request: its DecodeRequest without
        first token and proposal, and the KV manifest."""
        manifest = kv_manifest((spec.dtype, spec.shape_for(len(checked.ids))) for spec in self.pair.kv_layout)
        return WireDecodeRequest(self._header(checked)), manifest

    def prefill_many(
        self, checked: abc.Sequence[Checked], sinks: abc.Sequence[queue.Queue | None] = ()
    ) -> list[Prefilled]:
        """Run checked requests up to their DecodeRequests (or to their ends), in order, batched
        into shared steps (`submit`). A failed request fails the call after every one has ended
        (the first error is raised)."""
        sinks = list(sinks) or [None] * len(checked)
        tickets = [self.submit(c, s) for c, s in zip(checked, sinks, strict=True)]
        for ticket in tickets:
            self._run_until(ticket.job.done)
        failed = next((t.job.error for t in tickets if t.job.error is not None), None)
        if failed is not None:
            for ticket in tickets:  # the results nobody will get: their shared-memory KV goes too
                ticket.abandon()
            raise failed
        return [ticket.job.result for ticket in tickets]

    def submit(self, checked: Checked, sink: queue.Queue | None = None) -> Ticket:
        """Queue a checked request (`prefill` says what `sink` is); its `Ticket` gives the first
        token, then the rest.

        Concurrent requests are batched: whichever caller waiting on a ticket holds the model
        lock runs one step for every queued request at once: ONE target forward over the
        ragged prompts, chunked so a step takes at most `max_prefill_tokens` prompt tokens,
        and the first tokens of the prompts it completes; then the proposals (one batched
        draft) and KV exports of the requests whose first tokens an earlier step drew. So a
        first token goes out after its forward, never behind a proposal or an export, and
        the proposals and exports of one step's requests share the next step."""
        job = _Job(checked, self._sequence(checked), sink=sink)
        with self._jobs_lock:
            self._jobs.append(job)
        return Ticket(self, job)

    def _run_until(self, event: threading.Event) -> None:
        """Wait until `event` is set while the engine thread steps. It steps only while a
        caller waits for something not yet there, as if the callers stepped it themselves:
        requests submitted together share their first step, and a job nobody waits for (an
        abandoned one, the rest of one whose first token was taken) waits too."""
        if event.is_set():
            return
        with self._jobs_lock:
            self._waiters.append(event)
        try:
            while not event.is_set():
                self._start()
                event.wait(IDLE_EXIT_S)
        finally:
            with self._jobs_lock:
                self._waiters.remove(event)

    def _wanted(self) -> bool:
        """A step is due: jobs are queued and a caller waits (hold `_jobs_lock`)."""
        return bool(self._jobs) and any(not waiting.is_set() for waiting in self._waiters)

    def _start(self) -> None:
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        """The engine thread: steps while one is due; ends after IDLE_EXIT_S without one."""
        with on_device(self.config.device):
            while True:
                with self._jobs_lock:
                    due = self._wanted()
                if not due:
                    if not self._wake.wait(IDLE_EXIT_S):
                        with self._thread_lock, self._jobs_lock:
                            if not self._wanted():  # a caller after this sees no thread and starts one
                                self._thread = None
                                return
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                try:
                    with self._lock:
                        self._step()
                except Exception as err:  # a step that failed outside a job's own work: its jobs fail
                    log.exception("prefill step failed")
                    with self._jobs_lock:
                        jobs = list(self._jobs)
                    for job in jobs:
                        self._end(job, error=err)
                if self.metrics:
                    self.metrics.engine_step.labels("prefill").observe(time.perf_counter() - started)

    def _sequence(self, checked: Checked) -> Sequence:
        """A checked request's sequence (every default resolved in `check`)."""
        return Sequence(
            prompt=checked.ids,
            params=checked.params,
            budget=checked.max_new_tokens,
            eos_token_ids=tuple(self.pair.target.eos_token_ids),
            stop_token_ids=tuple(checked.sampling.stop_token_ids),
            rng=RequestRng(checked.params.seed, stream="prefill"),
            k=checked.k,
            candidates=checked.candidates,
            logprobs=checked.sampling.logprobs,
            method=self.proposer.method,
            grammar=checked.grammar,
        )

    def _step(self) -> None:
        target = self.pair.target
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in [job for job in jobs if job.abandoned]:
            self._end(job)  # its caller left: its KV goes back to the pool
        jobs = [job for job in jobs if not job.abandoned]
        # Drawn their first tokens in an earlier step: this step proposes and exports them.
        finishing = [job for job in jobs if job.first.is_set()]
        budget, chosen, chunks = self.config.max_prefill_tokens, [], []
        for job in jobs:  # arrival order; a long prompt takes the budget that is left
            if budget <= 0 or job.first.is_set():
                continue
            if job.seq.target_state is None:
                if not target.can_reserve(len(job.seq.prompt)):
                    continue  # waits until running prefills free their KV (check() refused any that never fits)
                job.seq.target_state = target.empty_state()
                target.reserve(job.seq.target_state, len(job.seq.prompt))
            chunk = job.seq.prompt[job.consumed : job.consumed + budget]
            chosen.append(job)
            chunks.append(chunk)
            budget -= len(chunk)
        if chosen:
            self._failing(chosen, lambda: self._prefill(chosen, chunks))
        if finishing:
            self._failing(finishing, lambda: self._finish(finishing))

    def _failing(self, jobs: list[_Job], work) -> None:
        """Run a step's work on `jobs`: if it fails, they fail (the caller running the step goes
        on with its own)."""
        try:
            work()
        except Exception as err:
            log.exception("prefill step failed")
            for job in jobs:
                if not job.done.is_set():
                    self._end(job, error=err)

    def _prefill(self, chosen: list[_Job], chunks: list[list[int]]) -> None:
        """One target forward over the chosen jobs' chunks; the first tokens of those it completes."""
        target = self.pair.target
        # Jobs whose prompt ends in this step and whose KV goes out as it is computed.
        shipping = [
            job
            for job, chunk in zip(chosen, chunks, strict=True)
            if job.sink is not None and job.consumed + len(chunk) == len(job.seq.prompt)
        ]
        if shipping and getattr(target, "layer_export", False):
            last = target.extend_last(  # [R, V]
                [job.seq.target_state for job in chosen], chunks, after_layer=self._shipper(shipping)
            )
        else:
            last = target.extend_last([job.seq.target_state for job in chosen], chunks)
        done = []
        for row, (job, chunk) in enumerate(zip(chosen, chunks, strict=True)):
            job.consumed += len(chunk)
            if job.consumed == len(job.seq.prompt):
                done.append((job, row))
        if done:
            self._first_tokens([job for job, _ in done], last[[row for _, row in done]])

    def _first_tokens(self, jobs: list[_Job], logits: torch.Tensor) -> None:
        """The first tokens (one batched draw), out to their callers at once; a request that
        ends there ends."""
        device = self.config.device
        rows = SamplingTensors.from_params([job.seq.params for job in jobs], device)
        uniforms = batch_uniforms([job.seq.rng for job in jobs], 1, device)  # [R, 1]
        logits = logits.to(device)
        law = logits  # [R, V]; restricted to each constrained row's grammar (the masked law)
        masks = [job.seq.grammar.masks([], []) for job in jobs if job.seq.grammar is not None]  # [1, W] each
        if masks:
            bitmask = torch.full((len(jobs), masks[0].shape[1]), -1, dtype=torch.int32)
            bitmask[[r for r, job in enumerate(jobs) if job.seq.grammar is not None]] = torch.cat(masks)
            law = restrict(logits, to_device(bitmask, device))
        firsts = sample_target(law[:, None], rows, uniforms).token_ids[:, 0].cpu().tolist()
        for row, (job, first) in enumerate(zip(jobs, firsts, strict=True)):
            _, reason = job.seq.append([first])
            logprob = None
            if job.seq.logprobs:
                logprob = token_logprobs(logits[row : row + 1], torch.tensor([first]), job.seq.logprobs)[0]
            job.first_token = FirstToken(first, logprob, reason)
            job.first.set()
            if reason:
                self._end(job, result=Prefilled(first, logprob, reason, None, None))

    def _finish(self, jobs: list[_Job]) -> None:
        """Proposals (one batched draft), then KV exports (a hidden-state head's with the
        target's); the proposer's per-request state lives until then."""
        try:
            drafted = self._propose(jobs)
            for job, proposal in zip(jobs, drafted, strict=True):
                self._export(job, proposal)
        finally:
            for job in jobs:
                self.proposer.stop(job.seq)

    def _export(self, job: _Job, proposal: Proposal) -> None:
        if job.sink is not None:
            self._ship_rest(job, proposal)
            return
        segment = self._segment(len(job.seq.prompt))
        try:
            if segment is None:
                kv = self.pair.export_state(job.seq.target_state)
            else:
                self.pair.export_state(job.seq.target_state, segment.tensors)
                segment.close()  # the KV is in the file: nothing of it stays mapped on this node
                kv = []
            self._end(job, result=self._decode_request(job, proposal, kv, segment))
        except BaseException:
            if segment is not None:
                segment.unlink()
            raise

    def _segment(self, prompt_len: int) -> SharedKvSegment | None:
        """Where a request's KV is exported with --kv-transport shm (None: new host tensors)."""
        layout = self.pair.kv_layout
        if self.config.kv_transport is not KvTransport.SHM or not layout:
            return None
        return SharedKvSegment.create([(spec.dtype, spec.shape_for(prompt_len)) for spec in layout])

    def _shipper(self, jobs: list[_Job]):
        """after_layer for the jobs whose KV ships as it is computed: layer i's keys and values
        of each job's whole prompt into its sink (earlier chunks' positions are in the pool)."""
        target = self.pair.target
        slots = {id(job): target.kv_slots(job.seq.target_state, len(job.seq.prompt)) for job in jobs}

        def after_layer(layer: int) -> None:
            for job in jobs:
                for index in (2 * layer, 2 * layer + 1):
                    copy = target.export_async(slots[id(job)], index)  # the sender waits for it, not the forward
                    job.sent_bytes += copy.host.numel() * copy.host.element_size()
                    job.sink.put((index, copy))

        return after_layer

    def _ship_rest(self, job: _Job, proposal: Proposal) -> None:
        """What a layer-by-layer job has not shipped (every tensor, for a target without
        after_layer; else a hidden-state head's, computed after the target's layers), then its
        proposal: the sink's last item."""
        state = job.seq.target_state
        rest = enumerate(self.pair.draft_tensors(state), len(self.pair.target.kv_layout))
        for index, tensor in rest if job.sent_bytes else enumerate(self.pair.export_state(state)):
            job.sent_bytes += tensor.numel() * tensor.element_size()
            job.sink.put((index, HostCopy(tensor)))
        tail = pdspec_pb2.DecodeRequest(first_token_id=job.seq.history[-1])
        wire = WireDecodeRequest(tail)
        encoding = self._encode(proposal, job.checked.k, tail, wire)
        job.sink.put(wire)
        job.sink = None  # ended
        result = Prefilled(job.seq.history[-1], job.first_token.logprob, "", wire, encoding, sent_bytes=job.sent_bytes)
        self._end(job, result=result)

    def _end(self, job: _Job, *, result: Prefilled | None = None, error: BaseException | None = None) -> None:
        """End a job; an abandoned job's result goes at once."""
        if job.sink is not None:
            job.sink.put(None)  # ended at its first token, or failed: the stream ends short
            job.sink = None
        if job.seq.target_state is not None:
            self.pair.target.release(job.seq.target_state)  # the KV lives on in the export (and then on the wire)
            job.seq.target_state = None
        with self._jobs_lock:
            if job in self._jobs:
                self._jobs.remove(job)
            job.result, job.error = result, error
            job.done.set()
            job.first.set()  # a job that failed before its first token: its caller wakes
            if job.abandoned:
                _drop(result)

    def _header(self, checked: Checked) -> pdspec_pb2.DecodeRequest:
        """The DecodeRequest fields known before the prefill (no first token, no proposal)."""
        header = pdspec_pb2.DecodeRequest(
            request_id=checked.request_id,
            protocol_version=self.contract.protocol_version,
            contract_fingerprint=self.fingerprint,
            prompt_token_ids=checked.ids,
            num_speculative_tokens=checked.k,
            sampling=checked.sampling,
            draft_candidates=checked.candidates,
        )
        if checked.constraint is not None:  # the decode node rebuilds the matcher from it
            checked.constraint.to_proto(header.structured_output)
        return header

    def _encode(
        self, proposal: Proposal, k: int, header: pdspec_pb2.DecodeRequest, wire: WireDecodeRequest
    ) -> ProposalEncoding:
        """The proposal into header.proposal, in the node's encoding; prompt lookup's always as
        POINT_MASS (target ids with no draft-space law). Returns the encoding used."""
        drafted = proposal.drafted
        encoding = self.config.encoding if drafted is not None else ProposalEncoding.POINT_MASS
        encode_proposal(
            torch.tensor(proposal.token_ids, dtype=torch.int64),
            torch.tensor(proposal.token_ids if drafted is None else drafted.draft_ids, dtype=torch.int64),
            None if drafted is None else drafted.probs,
            self.pair.draft.vocab_size,
            encoding,
            out=header.proposal,
            set_tensor=lambda name, tensor: wire.set_tensor(f"proposal.{name}", tensor),
            parents=None if proposal.is_chain else proposal.parents,
        )
        header.proposal.partial = proposal.is_chain and len(proposal.token_ids) != k
        return encoding

    def _decode_request(
        self, job: _Job, proposal: Proposal, kv: list[torch.Tensor], segment: SharedKvSegment | None
    ) -> Prefilled:
        header = self._header(job.checked)
        header.first_token_id = job.seq.history[-1]
        wire = WireDecodeRequest(header)
        encoding = self._encode(proposal, job.checked.k, header, wire)
        stream_kv = segment is None and bool(kv) and self.streams(kv)
        if segment is not None:
            header.kv_shm.CopyFrom(segment.handle)
        elif not stream_kv:
            for i, tensor in enumerate(kv):
                wire.set_tensor(f"kv_cache[{i}]", tensor)  # a view: no copy until the one join
        return Prefilled(
            job.seq.history[-1], job.first_token.logprob, "", wire, encoding, kv, segment, stream_kv=stream_kv
        )

    def streams(self, kv: list[torch.Tensor] | int) -> bool:
        """Whether this KV (tensors, or a byte count) goes over DecodeStream (see PrefillConfig.kv_streaming)."""
        size = kv if isinstance(kv, int) else sum(t.numel() * t.element_size() for t in kv)
        return self.config.kv_streaming or size > self.config.kv_stream_threshold_bytes

    def _propose(self, jobs: list[_Job]) -> list[Proposal]:
        """Each job's proposal after prompt + first token (engine/proposer.py): as deep as its K,
        or as its prompt-lookup match; the proposer's per-request state (a match index, a draft
        state over the prompt) is made for the rows that may draft, and for every row where the
        draft's state ships with the KV (a hidden-state head); the caller stops it."""
        seqs = [job.seq for job in jobs]
        proposer = self.proposer
        # A constrained request proposes what its grammar forces after the first token, when it
        # forces anything (jump-forward), and its point-mass drafts stop where the grammar forbids.
        forced = [jump_forward(seq.grammar, seq.k) for seq in seqs]
        drafting = [seq for seq, f in zip(seqs, forced, strict=True) if (seq.k and f is None) or self.pair.draft_ships]
        proposer.start(drafting, [len(seq.history) + proposer.max_nodes(seq.k, seq.candidates) for seq in drafting])
        plans = proposer.plan(seqs, [seq.k if f is None else 0 for seq, f in zip(seqs, forced, strict=True)])
        drafted = proposer.propose(seqs, plans, [plan.limit for plan in plans])
        return [
            guide(seq.grammar, proposal) if f is None else f
            for seq, proposal, f in zip(seqs, drafted, forced, strict=True)
        ]


@dataclass(eq=False)
class _Job:
    """One request inside the prefill engine: its prompt consumed in chunks, then finished."""

    checked: Checked
    seq: Sequence
    first: threading.Event = field(default_factory=threading.Event)  # first_token drawn (or the job failed)
    done: threading.Event = field(default_factory=threading.Event)
    consumed: int = 0  # prompt tokens the target has consumed
    first_token: FirstToken | None = None
    abandoned: bool = False  # its caller left: nobody takes the result
    result: Prefilled | None = None
    error: BaseException | None = None
    sink: queue.Queue | None = None  # layer by layer: where its KV and then its proposal go (prefill(sink=))
    sent_bytes: int = 0


class Ticket:
    """A submitted request: `first()`, then `result()`; each waits until the engine thread
    has it there. `abandon()` when the caller will not take the rest."""

    def __init__(self, engine: PrefillEngine, job: _Job) -> None:
        self.engine, self.job = engine, job

    def first(self) -> FirstToken:
        self.engine._run_until(self.job.first)
        if self.job.error is not None:
            raise self.job.error
        return self.job.first_token

    def result(self) -> Prefilled:
        self.engine._run_until(self.job.done)
        if self.job.error is not None:
            raise self.job.error
        return self.job.result

    def abandon(self) -> None:
        """The caller leaves: a request still running is dropped by the next step (waited for,
        so its KV is back in the pool on return); a finished one's shared-memory KV goes."""
        with self.engine._jobs_lock:
            self.job.abandoned = True
            if self.job.done.is_set():
                _drop(self.job.result)
        self.engine._run_until(self.job.done)


def _drop(result: Prefilled | None) -> None:
    """What a result nobody takes holds outside this process: its shared-memory KV."""
    if result is not None and result.shm is not None:
        result.shm.unlink()
