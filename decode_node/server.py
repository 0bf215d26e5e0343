"""DecodeService over gRPC: a thin servicer around the validator and the decode engine.

`run_server(config)` starts a real server (port 0 = any free port) with grpc.health.v1
(NOT_SERVING until the models are loaded), server reflection, message limits derived from
the model contract, and a Prometheus /metrics endpoint; leaving the context drains
in-flight requests within the grace period.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

import pdspec
from decode_node.engine import DecodeConfig, DecodeEngine
from decode_node.request import Event, QueueFull, Request
from engine.grammar import GRAMMAR, GrammarError
from engine.paged_lm import kv_pool_bytes, paged_pair
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics, SummaryLogger
from pdspec.modelspec import ModelSpec, backends, model_dtype
from pdspec.serving import NodeShell, pin_torch_threads
from pdspec.tls import ServerTls, ServiceGuard, transport_ceiling
from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.contract import max_message_bytes
from protos.proposal import ProposalEncoding, choose_encoding
from protos.rpc import add_decode_servicer
from protos.shm_kv import SharedKvError, mapped
from protos.status import ended_status, status_code, to_grpc_status
from protos.validation import (
    DecodeInput,
    Receiver,
    RequestLimits,
    Violation,
    declared_bytes,
    validate_decode_request,
)
from protos.wire import ParsedChunk, ParsedDecodeRequest
from sampling.proposal import PROPOSAL_SOURCES

log = logging.getLogger(__name__)
SERVICE = pdspec_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
ENCODING_LABELS = {
    pdspec_pb2.Proposal.DENSE: ProposalEncoding.DENSE.value,
    pdspec_pb2.Proposal.POINT_MASS: ProposalEncoding.POINT_MASS.value,
    pdspec_pb2.Proposal.SPARSE: ProposalEncoding.SPARSE.value,
}
# A request waiting in the queue sends an empty message this often, so the prefill node's relay
# watchdog (--decode-stall-seconds, 3 s) tells a queued request from a frozen decode node.
HEARTBEAT_S = 1.0
# A shared-memory KV is imported in slices of this size (a GPU stages each through its pinned buffer).
SHM_SLICE_BYTES = 4 << 20
VALIDATED_FIELDS = (
    "request_id",
    "protocol_version",
    "contract_fingerprint",
    "num_speculative_tokens",
    "prompt_token_ids",
    "first_token_id",
    "proposal.encoding",
    "proposal.token_ids",
    "proposal.probs",
    "proposal.sparse_ids",
    "proposal.sparse_probs",
    "kv_cache",
    "kv_manifest",
    "kv_shm",
    "kv",
    "request",
    "sampling.temperature",
    "sampling.top_k",
    "sampling.top_p",
    "sampling.max_new_tokens",
    "sampling.stop_token_ids",
    "sampling.logprobs",
)


@dataclass(frozen=True)
class DecodeNodeConfig:
    host: str = "0.0.0.0"
    port: int = 50052
    metrics_port: int | None = 9402  # None: no /metrics endpoint
    engine: DecodeConfig = field(default_factory=DecodeConfig)
    models: ModelSpec = field(default_factory=ModelSpec)
    max_message_bytes: int | None = None  # None: derived from the contract
    limits: RequestLimits = field(default_factory=RequestLimits)  # max_prompt_tokens sizes the message limit
    grace_s: float = 5.0
    log_stats_s: float = 10.0  # period of the summary log line (0 = off)
    tls: ServerTls | None = None  # TLS; with its `ca`, mTLS: only clients that CA signed
    accept_shm_kv: bool = False  # --accept-shm-kv: take a KV in shared memory (DecodeRequest.kv_shm)
    # --peer-token-file: DecodeService calls must carry `authorization: Bearer <token>` (the
    # prefill node's); None = any caller that reaches the port (a private network only)
    peer_token: str | None = None
    torch_threads: int | None = None  # --torch-threads (resolved); None = torch's own default


class DecodeServicer(pdspec_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: DecodeEngine, receiver: Receiver, metrics: NodeMetrics, info: pdspec_pb2.NodeInfo):
        self.engine = engine
        self.receiver = receiver
        self.metrics = metrics
        self.info = info

    def GetInfo(self, request, context):
        return self.info

    def Decode(self, request: ParsedDecodeRequest | pdspec_pb2.DecodeRequest, context: grpc.ServicerContext):
        """`request` as protos.rpc parses it (payload views), or a plain message (tests)."""
        if isinstance(request, pdspec_pb2.DecodeRequest):
            request = ParsedDecodeRequest(request, proposal_bytes=request.proposal.ByteSize())
        return self._call(self._decode(request, context), context)

    def DecodeStream(self, chunks: Iterator[ParsedChunk], context: grpc.ServicerContext):
        """The first chunk: request + KV manifest; then the KV slices (protos/pdspec.proto)."""
        return self._call(self._decode_stream(chunks, context), context)

    def _call(self, body, context):
        started = time.monotonic()
        outcome = ["OK"]
        try:
            yield from body(started, outcome)
        except GeneratorExit:  # gRPC closed the stream: the client cancelled or its deadline passed
            outcome[0] = ended_status(context)
            raise
        except Exception:  # an abort from a read of the request stream (ServiceGuard), or a fault
            if outcome[0] == "OK":
                code = context.code()
                outcome[0] = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
            raise
        finally:
            self.metrics.finish_request(started, outcome[0])

    def _reject(self, violations, request_id: str, context, outcome: list[str]) -> None:
        for violation in violations:
            self.metrics.validation_rejections.labels("decode", violation.field).inc()
        outcome[0] = status_code(violations).name
        context.abort_with_status(to_grpc_status(violations, request_id))

    def _validated(
        self, request: ParsedDecodeRequest, context, outcome, kv_manifest=None, *, proposal_follows: bool = False
    ) -> DecodeInput:
        if request.error is not None:
            self._reject([request.error], "", context, outcome)
        result = validate_decode_request(
            request.header, self.receiver, request.payloads, kv_manifest, proposal_follows=proposal_follows
        )
        if not isinstance(result, DecodeInput):
            self._reject(result, request.request_id, context, outcome)
        if not proposal_follows:  # counted with the proposal, from the stream's last chunk
            self.metrics.proposal_bytes.labels("decode", ENCODING_LABELS[request.header.proposal.encoding]).inc(
                request.proposal_bytes
            )
        return result

    def _decode(self, request: ParsedDecodeRequest, context):
        def body(started: float, outcome: list[str]):
            result = self._validated(request, context, outcome)
            shared = request.header.kv_shm if request.header.HasField("kv_shm") else None
            handle = self._submit(result, context, outcome, streamed=shared is not None)
            try:
                if shared is not None:  # the KV in shared memory: imported like a stream's chunks
                    if not (yield from self._reserved(handle, context, outcome)):
                        return
                    yield from self._import_shared(handle, shared, context, outcome)
                else:
                    self.metrics.kv_bytes.labels("decode").inc(request.kv_bytes)
                yield from self._generate(handle, context, started, outcome)
            finally:
                self.engine.cancel(handle)  # every way out (return, abort, a closed stream) frees the slot

        return body

    def _decode_stream(self, chunks: Iterator[ParsedChunk], context):
        def body(started: float, outcome: list[str]):
            try:
                first = next(chunks, None)
            except grpc.RpcError:  # the client went away before its first chunk
                outcome[0] = ended_status(context)
                return
            result = self._first_chunk(first, context, outcome)
            handle = self._submit(result, context, outcome, streamed=True)
            try:
                if not (yield from self._reserved(handle, context, outcome)):
                    return
                tail = first.request if first.proposal_follows else None
                if not (yield from self._upload(handle, chunks, first.manifest, context, outcome, tail)):
                    return  # the client went away mid-upload: what was reserved is freed below
                yield from self._generate(handle, context, started, outcome)
            finally:
                self.engine.cancel(handle)

        return body

    def _first_chunk(self, first: ParsedChunk | None, context, outcome: list[str]) -> DecodeInput:
        """The request and KV manifest of a DecodeStream's first chunk, validated."""
        if first is None or first.error is not None or first.request is None:
            problem = "no chunks" if first is None else "a chunk without a request"
            self._reject(
                [
                    first.error
                    if first and first.error
                    else Violation("request", "a first chunk with the request", problem)
                ],
                "",
                context,
                outcome,
            )
        if first.kv is not None:
            rid = first.request.request_id
            self._reject([Violation("kv", "no KV slice in the first chunk", "a slice")], rid, context, outcome)
        return self._validated(first.request, context, outcome, first.manifest, proposal_follows=first.proposal_follows)

    def _submit(self, result: DecodeInput, context, outcome: list[str], *, streamed: bool = False) -> Request:
        try:
            if result.constraint is not None:
                self.metrics.structured_requests.labels("decode", result.constraint.kind).inc()
            return self.engine.submit(result, streamed=streamed)
        except GrammarError as err:  # a direct caller: the prefill node compiled it and drew the first token under it
            self._reject(
                [Violation(err.field, err.expected, err.message)],
                result.request_id,
                context,
                outcome,
            )
        except QueueFull as err:
            outcome[0] = "RESOURCE_EXHAUSTED"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {result.request_id!r}: queue full ({err})")

    def _reserved(self, handle: Request, context, outcome: list[str]):
        """Wait (sending heartbeats) until a streamed request's KV is reserved; False if the call ended."""
        while not handle.reserved.wait(HEARTBEAT_S):  # the pool is full: queued like any request
            if not context.is_active():
                outcome[0] = ended_status(context)
                return False
            yield pdspec_pb2.GenerateResponse(request_id=handle.input.request_id)
        return True

    def _upload(
        self,
        handle: Request,
        chunks: Iterator[ParsedChunk],
        manifest,
        context,
        outcome: list[str],
        header: ParsedDecodeRequest | None = None,
    ):
        """Write each KV slice into the reserved storage as it arrives; any gap, overlap or
        overrun is INVALID_ARGUMENT; False if the call ended first. Heartbeats go out meanwhile:
        an upload of gigabytes takes seconds, longer than the prefill's relay watchdog waits.
        `header`: the first chunk's request when its proposal follows; the last chunk then
        brings first_token_id and the proposal, validated with the header (`_proposal`)."""
        rid = handle.input.request_id
        sizes = [declared_bytes(pb) for pb in manifest]
        got = [0] * len(sizes)
        sent = time.monotonic()
        while True:
            try:
                chunk = next(chunks, None)
            except grpc.RpcError:  # the client cancelled, or its deadline passed
                outcome[0] = ended_status(context)
                return False
            if chunk is None:
                break
            if header is not None and chunk.error is None and chunk.request is not None:
                if got != sizes:  # the proposal comes after the KV: the engine may start at once
                    problem = Violation("request", "the proposal after every KV byte", f"{sum(got)} bytes in")
                    self._reject([problem], rid, context, outcome)
                self._proposal(handle, header, chunk, manifest, context, outcome)
                header = None
                continue
            problem = chunk.error
            if problem is None and (chunk.kv is None or chunk.request is not None or chunk.manifest):
                problem = Violation("kv", "a chunk with a KV slice only", "a request, manifest or nothing")
            if problem is None:
                i, offset, size = chunk.kv.tensor_index, chunk.kv.offset, len(chunk.data)
                if not 0 <= i < len(sizes):
                    problem = Violation("kv.tensor_index", f"0..{len(sizes) - 1}", str(i))
                elif offset != got[i]:
                    problem = Violation(f"kv[{i}].offset", f"{got[i]} (the bytes received so far)", str(offset))
                elif offset + size > sizes[i]:
                    problem = Violation(f"kv[{i}].data", f"at most {sizes[i] - offset} bytes", f"{size} bytes")
            if problem is not None:
                self._reject([problem], rid, context, outcome)
            self.engine.import_chunk(handle, i, offset, chunk.data)
            got[i] += size
            del chunk  # the message's bytes go before the next one is read: one held at a time
            if time.monotonic() - sent > HEARTBEAT_S:
                sent = time.monotonic()
                yield pdspec_pb2.GenerateResponse(request_id=rid)
        missing = [i for i, size in enumerate(sizes) if got[i] != size]
        if (missing or header is not None) and _ends(context):
            outcome[0] = ended_status(context)
            return False
        if header is not None and not missing:
            self._reject([Violation("request", "a last chunk with the proposal", "none")], rid, context, outcome)
        if missing:
            i = missing[0]
            self._reject(
                [Violation(f"kv[{i}]", f"{sizes[i]} bytes", f"{got[i]} bytes ({len(missing)} tensors short)")],
                rid,
                context,
                outcome,
            )
        self.metrics.kv_bytes.labels("decode").inc(sum(got))
        self.engine.imported(handle)
        return True

    def _proposal(
        self, handle: Request, header: ParsedDecodeRequest, last: ParsedChunk, manifest, context, outcome
    ) -> None:
        """The request a proposal-last stream makes: its header with the last chunk's
        first_token_id and proposal, validated as one and handed to the engine; its KV positions
        must be within what was reserved for the header."""
        merged = pdspec_pb2.DecodeRequest()
        merged.CopyFrom(header.header)
        merged.first_token_id = last.request.header.first_token_id
        merged.proposal.CopyFrom(last.request.header.proposal)
        request = ParsedDecodeRequest(merged, last.request.payloads, None, last.wire_bytes, last.request.proposal_bytes)
        result = self._validated(request, context, outcome, manifest)
        needed = self.engine.receive(handle, result)
        if needed > handle.kv_need:
            problem = Violation(
                "proposal.token_ids",
                f"a proposal within the {handle.kv_need} KV positions reserved for the header",
                f"{len(result.proposal.token_ids)} nodes ({needed} positions)",
            )
            self._reject([problem], handle.input.request_id, context, outcome)

    def _import_shared(self, handle: Request, shared: pdspec_pb2.SharedKv, context, outcome: list[str]):
        """Import a validated shared-memory KV from its mapping, a slice at a time (heartbeats between)."""
        rid = handle.input.request_id
        sent = time.monotonic()
        try:
            with mapped(shared) as view:
                for i, (start, length) in enumerate(zip(shared.offsets, shared.lengths, strict=True)):
                    for offset in range(0, length, SHM_SLICE_BYTES):
                        end = start + min(offset + SHM_SLICE_BYTES, length)
                        self.engine.import_chunk(handle, i, offset, view[start + offset : end])
                    if time.monotonic() - sent > HEARTBEAT_S:
                        sent = time.monotonic()
                        yield pdspec_pb2.GenerateResponse(request_id=rid)
        except SharedKvError as err:
            self._reject([err.violation], rid, context, outcome)
        self.metrics.kv_bytes.labels("decode").inc(sum(shared.lengths))
        self.engine.imported(handle)

    def _generate(self, handle: Request, context, started: float, outcome: list[str]):
        rid = handle.input.request_id
        # A client cancel or deadline cancels the engine request. add_callback returns False
        # when the RPC has already ended (a 1 ms deadline can expire before this line): then
        # nothing would ever call it, so cancel now. The callback holds the request weakly:
        # gRPC drops it on its serving thread, which is not to free the request's tensors
        # (pdspec.serving.NodeShell.stop says why).
        if not context.add_callback(_canceller(self.engine, handle)):
            self.engine.cancel(handle)
        first, last, sent = True, started, started
        while True:
            try:
                event: Event | None = handle.events.get(timeout=0.25)
            except queue.Empty:
                event = None
            if not context.is_active():  # checked on every event, not only when idle
                outcome[0] = ended_status(context)
                return
            if event is None:
                if time.monotonic() - sent > HEARTBEAT_S:  # queued for a slot: not a silent node
                    sent = time.monotonic()
                    yield pdspec_pb2.GenerateResponse(request_id=rid)
                continue
            event = _coalesce(event, handle.events)
            if event.error:
                outcome[0] = "INTERNAL"
                context.abort(grpc.StatusCode.INTERNAL, f"request {rid!r}: {event.error}")
            now = time.monotonic()
            ttft = first and bool(event.tokens)
            self.metrics.streamed(len(event.tokens), now - (started if ttft else last), ttft)
            first = first and not event.tokens
            last = sent = now
            yield _response(rid, event)
            if event.finished:
                if (state := handle.seq.grammar) is not None:
                    self.metrics.record_grammar(state.mask_seconds, state.rejected_drafts, state.jump_forward_tokens)
                return


def _canceller(engine: DecodeEngine, handle: Request) -> Callable[[], None]:
    """engine.cancel(handle) while the request lives, without keeping it alive."""
    ref = weakref.ref(handle)

    def cancel() -> None:
        if (request := ref()) is not None:
            engine.cancel(request)

    return cancel


def _ends(context, within_s: float = 0.5) -> bool:
    """Whether the call is ending (cancelled, past its deadline). gRPC can end a cancelled
    request stream the way a client ends a short one, and report the cancel a moment later."""
    end = time.monotonic() + within_s
    while context.is_active():
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)
    return True


def _coalesce(event: Event, events: queue.SimpleQueue) -> Event:
    """The event and every later one already queued, as one: a stream that fell behind the
    engine catches up in one message instead of one per step."""
    while not (event.finished or event.error):
        try:
            later: Event = events.get_nowait()
        except queue.Empty:
            break
        event = Event(
            event.tokens + later.tokens,
            later.finished,
            later.finish_reason,
            later.stats,
            later.error,
            event.logprobs + later.logprobs,
        )
    return event


def _response(request_id: str, event: Event) -> pdspec_pb2.GenerateResponse:
    response = pdspec_pb2.GenerateResponse(
        request_id=request_id, token_ids=event.tokens, finished=event.finished, finish_reason=event.finish_reason
    )
    if event.stats is not None:
        s = event.stats
        response.stats.CopyFrom(
            pdspec_pb2.RequestStats(
                verify_steps=s.verify_steps,
                draft_tokens=s.draft_tokens,
                accepted_tokens=s.accepted_tokens,
                accepted_per_position=s.accepted_per_position,
                accepted_per_rank=s.accepted_per_rank,
                chosen_k=s.chosen_k,
                speculative_method=s.method,
                prompt_lookup_tokens=s.prompt_lookup_tokens,
                jump_forward_tokens=s.jump_forward_tokens,
                grammar_rejected_drafts=s.grammar_rejected_drafts,
            )
        )
    for entry in event.logprobs:
        response.logprobs.add(logprob=entry.logprob, top_token_ids=entry.top_token_ids, top_logprobs=entry.top_logprobs)
    return response


@dataclass
class RunningDecodeNode:
    server: grpc.Server
    port: int
    metrics: NodeMetrics
    metrics_port: int | None
    engine: DecodeEngine
    shell: NodeShell


def node_info(pair: ModelPair, config: DecodeNodeConfig, engine: DecodeEngine) -> pdspec_pb2.NodeInfo:
    contract = pair.contract()
    engine_config = config.engine
    return pdspec_pb2.NodeInfo(
        role="decode",
        protocol_version=contract.protocol_version,
        contract_fingerprint=contract.fingerprint(),
        target_vocab_size=contract.target_vocab_size,
        draft_vocab_size=contract.draft_vocab_size,
        draft_to_target=list(contract.d2t),
        sampler_backend=engine.verifier.backend,
        device=engine_config.device,
        target_model=contract.target_model,
        draft_model=contract.draft_model,
        # what this node expects by default: the prefill default for its draft law
        proposal_encoding=choose_encoding(None, engine_config.spec.draft_law, False).value,
        version=pdspec.__version__,
        dtype=model_dtype(pair),
        backends=json.dumps(
            {**backends(pair, engine.verifier.backend), "scheduling": "async" if engine.pipelined else "sync"}
        ),
        max_new_tokens_limit=config.limits.max_new_tokens,
        max_prompt_tokens=config.limits.max_prompt_tokens,
        accepts_shm_kv=config.accept_shm_kv,
        **engine_config.spec.info(engine.proposer.trees, engine_config.spec.adaptive),
        kv_pool_bytes=kv_pool_bytes(pair),
    )


def server_options(limit: int) -> list[tuple[str, int]]:
    """The decode node's gRPC server settings (bench/wire_kv.py serves with them too). gRPC's
    receive limit is above `limit`: the node's ServiceGuard refuses (and counts) what is
    between the two (pdspec.tls.transport_ceiling)."""
    return [
        ("grpc.max_receive_message_length", transport_ceiling(limit)),
        ("grpc.max_send_message_length", limit),
        # the prefill node's keepalive pings (how it notices a dead peer within seconds)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
        # Without BDP probing a stream's window grows to the message being read and not beyond:
        # an upload then holds ~5 chunks of 1 MiB in this process, where probing let the read-ahead
        # reach 8 (tests/nodes/test_kv_import.py); the loopback throughput: BENCHMARKS.md.
        ("grpc.http2.bdp_probe", 0),
    ]


@contextlib.contextmanager
def run_server(
    config: DecodeNodeConfig,
    pair_loader: Callable[[], ModelPair] | None = None,
    engine_factory: Callable[..., DecodeEngine] = DecodeEngine,
) -> Iterator[RunningDecodeNode]:
    """Load the models, start serving; NOT_SERVING is reported until both are done."""
    pin_torch_threads(config.torch_threads, "decode")
    config.models.check_memory()
    before = config.models.reserved()
    pair = paged_pair(
        (pair_loader or config.models.load)(),
        config.models.kv_budget(before),
        eager=config.models.enforce_eager,
        attention=config.models.attention_backend,
        capture=config.models.graph_capture(
            max_k=config.engine.spec.max_speculative_tokens, decode=True, max_batch=config.engine.max_batch
        ),
    )
    contract = pair.contract()
    spec = config.engine.spec
    trees = spec.candidates(pair.supports_trees) > 1
    rows = max(spec.max_speculative_tokens, spec.max_tree_nodes if trees else 0)  # proposal rows
    limit = config.max_message_bytes or max_message_bytes(contract, rows, config.limits.max_prompt_tokens)
    metrics = NodeMetrics(
        "decode",
        spec.max_speculative_tokens,
        VALIDATED_FIELDS,
        methods=[spec.method],
        sources=(*PROPOSAL_SOURCES, GRAMMAR),
    )
    shell = NodeShell(
        SERVICE,
        host=config.host,
        port=config.port,
        streams=config.engine.max_batch + config.engine.max_queue,
        options=server_options(limit),
        metrics=metrics,
        metrics_port=config.metrics_port,
        tls=config.tls,
        interceptors=[
            ServiceGuard(
                SERVICE,
                lambda code: metrics.finish_request(time.monotonic(), code),
                config.peer_token,
                what="peer token",
                max_request_bytes=limit,
            )
        ],
    )
    engine = engine_factory(pair, config.engine, metrics)
    engine.calibrate()
    receiver = Receiver(
        contract,
        spec.max_speculative_tokens,
        pair.d2t,
        config.limits,
        max_draft_candidates=spec.candidates(engine.proposer.trees),
        max_tree_nodes=spec.max_tree_nodes,
        accept_shm_kv=config.accept_shm_kv,
    )
    info = node_info(pair, config, engine)
    metrics.node_info.info(
        {
            "role": "decode",
            "version": info.version,
            "target_model": info.target_model,
            "draft_model": info.draft_model,
            "device": info.device,
            "sampler_backend": info.sampler_backend,
        }
    )
    metrics.running.labels("decode").set_function(lambda: engine.running)
    metrics.waiting.labels("decode").set_function(lambda: engine.waiting)
    add_decode_servicer(DecodeServicer(engine, receiver, metrics, info), shell.server)
    shell.start()  # raises when the port is taken: nothing is running yet
    engine.start()
    summary = SummaryLogger(metrics, config.log_stats_s)
    summary.start()
    shell.set_serving(True)
    log.info(
        "decode node serving on %s:%d (%s, %s, message limit %d bytes)",
        config.host,
        shell.port,
        "plaintext" if config.tls is None else "mTLS" if config.tls.mutual else "TLS",
        "peer token required" if config.peer_token else "no peer token",
        limit,
    )
    if config.peer_token is None and (config.tls is None or not config.tls.mutual):
        log.warning(
            "DecodeService accepts any caller that reaches %s:%d (no --peer-token-file, no mTLS): "
            "keep the port on a private network",
            config.host,
            shell.port,
        )
    try:
        yield RunningDecodeNode(shell.server, shell.port, metrics, shell.metrics_port, engine, shell)
    finally:
        summary.stop()
        shell.stop(config.grace_s)
        engine.stop()
