"""The prefill node's one generation path: check, prefill, relay the decode stream.

Both front ends call `GenerationService.generate`: the gRPC servicer hands it its
ServicerContext, the OpenAI HTTP API an equivalent `Call` of its own. Failures are raised
as `RequestFailed` with the gRPC status name; each front end renders them in its own shape.
Every request is counted once in the metrics with its final status, and logged once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pdspec.metrics import NodeMetrics
from prefill_node.engine import Checked, Prefilled, PrefillEngine
from prefill_node.stop_strings import StopStrings
from prefill_node.watchdog import StallWatchdog
from protos import pdspec_pb2
from protos.status import ended_status, status_code
from protos.validation import Violation
from protos.wire import layered_chunks, stream_chunks
from sampling.logprobs import TokenLogprob

log = logging.getLogger(__name__)
# gRPC Python reports "the client set no deadline" as ~9.2e18 s remaining; passed on as a
# timeout that overflows into an immediate DEADLINE_EXCEEDED. Anything beyond a year is
# taken to mean no deadline.
NO_DEADLINE_S = 365 * 24 * 3600.0
# Statuses of a relayed decode call that the client sees as they are; the rest (the peer
# died, reset the stream, ...) become UNAVAILABLE.
PASSED_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


class Call(Protocol):
    """What the service needs of the client's call (grpc.ServicerContext has all three)."""

    def is_active(self) -> bool: ...
    def time_remaining(self) -> float | None: ...
    def add_callback(self, callback: Callable[[], None]) -> bool: ...


class Peer(Protocol):
    """The decode peer as the service sees it (prefill_node.server.DecodePeer)."""

    stub: object
    compatible: bool
    problem: str

    def recheck(self) -> None: ...


@dataclass
class RequestFailed(Exception):
    """A request that ends with a non-OK status; `violations` for INVALID_ARGUMENT."""

    code: str  # grpc.StatusCode name
    message: str
    request_id: str = ""
    violations: Sequence[Violation] = field(default_factory=list)

    def __str__(self) -> str:
        return self.message


@dataclass
class _Record:
    """What the request's log line and metrics say when it ends."""

    request_id: str = ""
    prompt_tokens: int = 0
    generated: int = 0
    k: int = 0
    stats: pdspec_pb2.RequestStats | None = None
    ttft: float | None = None
    code: str = "OK"


def decode_timeout(call: Call) -> float | None:
    """The client's remaining deadline for the relayed decode call; None when it set none."""
    remaining = call.time_remaining()
    return None if remaining is None or remaining > NO_DEADLINE_S else remaining


class GenerationService:
    def __init__(
        self,
        engine: PrefillEngine,
        peer: Peer,
        metrics: NodeMetrics,
        max_streams: int = 160,
        watchdog: StallWatchdog | None = None,
    ) -> None:
        self.engine = engine
        self.watchdog = watchdog or StallWatchdog(0)  # cancels relays that stop making progress
        self.peer = peer
        self.metrics = metrics
        self.max_streams = max_streams
        self.in_flight = 0  # admitted requests not yet ended (the running gauge)
        self._lock = threading.Lock()

    def check(self, request: pdspec_pb2.GenerateRequest) -> Checked:
        """The request's checks alone (RequestFailed INVALID_ARGUMENT), counted by field."""
        checked = self.engine.check(request)
        if isinstance(checked, Checked):
            if checked.constraint is not None:
                self.metrics.structured_requests.labels("prefill", checked.constraint.kind).inc()
            return checked
        for violation in checked:
            self.metrics.validation_rejections.labels("prefill", violation.field).inc()
        message = "; ".join(str(v) for v in checked)
        rid = request.request_id
        raise RequestFailed(status_code(checked).name, f"request {rid!r}: {message}", rid, checked)

    def generate(self, request: pdspec_pb2.GenerateRequest, call: Call) -> Iterator[pdspec_pb2.GenerateResponse]:
        """The response stream of one request; raises RequestFailed on a non-OK end."""
        started = time.monotonic()
        record = _Record(request_id=request.request_id)
        with self._lock:
            admitted = self.in_flight < self.max_streams
            self.in_flight += admitted
        try:
            if not admitted:
                raise RequestFailed(
                    "RESOURCE_EXHAUSTED",
                    f"request {request.request_id!r}: {self.max_streams} requests in flight (--max-streams)",
                    request.request_id,
                )
            yield from self._generate(request, call, started, record)
        except RequestFailed as err:
            record.code = err.code
            raise
        except GeneratorExit:  # the front end closed the stream: the client went away
            record.code = ended_status(call)
            raise
        except Exception:
            record.code = "INTERNAL"
            raise
        finally:
            with self._lock:
                self.in_flight -= admitted
            self._finish(record, started)

    def _generate(self, request, call: Call, started: float, record: _Record):
        checked = self.check(request)
        rid = record.request_id = checked.request_id
        record.prompt_tokens, record.k = len(checked.ids), checked.k
        if not self.peer.compatible:
            raise RequestFailed("UNAVAILABLE", f"request {rid!r}: {self.peer.problem}", rid)
        self.metrics.prompt_tokens.labels("prefill").inc(len(checked.ids))
        relay = None
        if self.engine.layerwise(checked):  # the decode stream opens first: each layer's KV goes as it is computed
            sink: queue.Queue = queue.Queue()
            header, manifest = self.engine.stream_header(checked)
            chunks = layered_chunks(header, manifest, sink, self.engine.config.kv_chunk_bytes)
            relay = self.peer.stub.DecodeStream(chunks, timeout=decode_timeout(call))
            ticket = self.engine.submit(checked, sink)
        else:
            ticket = self.engine.submit(checked)
        try:
            # The first token goes out as soon as it is drawn; the proposal and the KV export
            # follow in the engine's next step.
            first = ticket.first()
            detokenizer = self.engine.pair.tokenizer.incremental()
            stops = StopStrings(request.stop)
            stream = _Stream(self.metrics, record, started)
            response = pdspec_pb2.GenerateResponse(request_id=rid, token_ids=[first.token])
            _add_logprobs(response, [first.logprob] if first.logprob else [])
            text, stopped = stops.push(detokenizer.push([first.token]))
            response.text = text
            if first.finish_reason or stopped:
                yield stream.finish(response, "stop" if stopped else first.finish_reason, detokenizer, stops, stopped)
                return
            yield stream.emit(response)
            if not call.is_active():  # the client left while we prefilled: start nothing
                record.code = ended_status(call)
                return
            prefilled = ticket.result()
            yield from self._relay(call, record, prefilled, relay, _Relayed(stream, detokenizer, stops))
        finally:
            if relay is not None:  # opened before the prefill: every way out ends it (a no-op once done)
                relay.cancel()
            # A request that has not ended is dropped (its KV back in the pool); an ended one's
            # shared-memory KV goes (the decode node unlinks it once mapped; this covers every other end).
            ticket.abandon()

    def _relay(self, call: Call, record: _Record, prefilled: Prefilled, relay, out: _Relayed):
        """The decode node's stream after the first token (the KV handed over on the way).
        `relay`: that stream, opened before the prefill (layer by layer; the caller ends it)."""
        rid = record.request_id
        stream, detokenizer, stops = out.stream, out.detokenizer, out.stops
        wire = prefilled.wire
        self.metrics.proposal_bytes.labels("prefill", prefilled.encoding.value).inc(wire.header.proposal.ByteSize())
        self.metrics.kv_bytes.labels("prefill").inc(prefilled.kv_bytes)
        if relay is None:  # else it opened before the prefill: the KV and the proposal are on their way
            if not prefilled.stream_kv:
                relay = self.peer.stub.Decode(wire, timeout=decode_timeout(call))  # the KV inline, or its handle
            else:  # DecodeStream: header + manifest, then the KV in slices
                chunks = stream_chunks(wire, prefilled.kv, self.engine.config.kv_chunk_bytes)
                relay = self.peer.stub.DecodeStream(chunks, timeout=decode_timeout(call))
        # A client cancel cancels the decode stream; add_callback returns False when the call
        # already ended, and then nothing would call it.
        if not call.add_callback(relay.cancel):
            relay.cancel()
        complete = False  # the decode stream ended by itself: nothing to cancel
        watch = self.watchdog.watch(relay.cancel)
        try:
            for response in relay:
                watch.touch()
                if not call.is_active():
                    record.code = ended_status(call)
                    return
                if not response.token_ids and not response.finished:
                    continue  # decode's heartbeat while the request waits for a slot
                response.text, stopped = stops.push(detokenizer.push(response.token_ids))
                if stopped or response.finished:
                    complete = not stopped
                    if complete:
                        # Read the stream's end (its OK status) before answering: a call dropped
                        # unread is cancelled, and decode would count a finished request CANCELLED.
                        for _ in relay:
                            pass
                    reason = "stop" if stopped else response.finish_reason
                    watch.hold()  # decode is done with it: the last message waits on the client alone
                    yield stream.finish(response, reason, detokenizer, stops, stopped)
                    return
                watch.hold()  # a slow client's flow control is not a silent decode node
                yield stream.emit(response)
                watch.touch()
        except grpc.RpcError as err:
            if not call.is_active():
                record.code = ended_status(call)
                return
            if watch.stalled:
                self.peer.recheck()
                message = f"request {rid!r}: decode node sent nothing for {self.watchdog.stall_s:g}s (stalled)"
                raise RequestFailed("UNAVAILABLE", message, rid) from err
            code = err.code() if err.code() in PASSED_THROUGH else grpc.StatusCode.UNAVAILABLE
            if code is grpc.StatusCode.UNAVAILABLE:
                self.peer.recheck()
            message = f"request {rid!r}: decode node: {err.code().name}: {err.details()}"
            raise RequestFailed(code.name, message, rid) from err
        finally:
            watch.done()
            if not complete:
                relay.cancel()  # every other way out (a client gone, an error, a stop string) ends it

    def _finish(self, record: _Record, started: float) -> None:
        latency = time.monotonic() - started
        self.metrics.finish_request(started, record.code)
        stats = record.stats or pdspec_pb2.RequestStats()
        log.info(
            "request %s %s: prompt %d tokens, generated %d, K %d, accepted %d/%d, ttft %s, latency %.3fs",
            record.request_id or "-",
            record.code,
            record.prompt_tokens,
            record.generated,
            record.k,
            stats.accepted_tokens,
            stats.draft_tokens,
            f"{record.ttft:.3f}s" if record.ttft is not None else "-",
            latency,
        )


@dataclass
class _Relayed:
    """A request's response stream as the relay continues it."""

    stream: _Stream
    detokenizer: object
    stops: StopStrings


class _Stream:
    """Per-response bookkeeping: token metrics, TTFT, inter-token latency, the final stats."""

    def __init__(self, metrics: NodeMetrics, record: _Record, started: float) -> None:
        self.metrics, self.record, self.last = metrics, record, started

    def emit(self, response: pdspec_pb2.GenerateResponse) -> pdspec_pb2.GenerateResponse:
        now = time.monotonic()
        n = len(response.token_ids)
        first = self.record.ttft is None
        if first:
            self.record.ttft = now - self.last
        self.metrics.streamed(n, now - self.last, first)
        self.last = now
        self.record.generated += n
        return response

    def finish(
        self, response: pdspec_pb2.GenerateResponse, reason: str, detokenizer, stops: StopStrings, stopped: bool
    ) -> pdspec_pb2.GenerateResponse:
        if not stopped:
            tail, stopped_late = stops.push(detokenizer.flush())
            response.text += tail if stopped_late else tail + stops.flush()
            reason = "stop" if stopped_late else reason
        response.finished, response.finish_reason = True, reason
        response.stats.SetInParent()
        self.record.stats = response.stats
        return self.emit(response)


def _add_logprobs(response: pdspec_pb2.GenerateResponse, entries: Sequence[TokenLogprob]) -> None:
    for entry in entries:
        response.logprobs.add(logprob=entry.logprob, top_token_ids=entry.top_token_ids, top_logprobs=entry.top_logprobs)
