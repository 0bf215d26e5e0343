"""DecodeService over gRPC: a thin servicer around the validator and the decode engine.

`run_server(config)` starts a real server (port 0 = any free port) with grpc.health.v1
(NOT_SERVING until the models are loaded), server reflection, message limits derived from
the model contract, and a Prometheus /metrics endpoint; leaving the context drains
in-flight requests within the grace period.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from decode_node.engine import DecodeConfig, DecodeEngine, Event, QueueFull
from models.loader import load_pair
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics
from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.contract import max_message_bytes
from protos.proposal import ProposalEncoding
from protos.status import status_code, to_grpc_status
from protos.validation import DecodeInput, Receiver, validate_decode_request

log = logging.getLogger(__name__)
SERVICE = pdspec_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
ENCODING_LABELS = {
    pdspec_pb2.Proposal.DENSE: ProposalEncoding.DENSE.value,
    pdspec_pb2.Proposal.POINT_MASS: ProposalEncoding.POINT_MASS.value,
    pdspec_pb2.Proposal.SPARSE: ProposalEncoding.SPARSE.value,
}
VALIDATED_FIELDS = (
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
    "sampling.temperature",
    "sampling.top_k",
    "sampling.top_p",
    "sampling.max_new_tokens",
    "sampling.stop_token_ids",
)


@dataclass(frozen=True)
class DecodeNodeConfig:
    host: str = "0.0.0.0"
    port: int = 50052
    metrics_port: int | None = 9402  # None: no /metrics endpoint
    engine: DecodeConfig = field(default_factory=DecodeConfig)
    corpus: Path | None = None  # built-in pair's training corpus (None = Python's stdlib)
    target_model: Path | None = None  # HF checkpoints (both or neither); default: the built-in pair
    draft_model: Path | None = None
    max_message_bytes: int | None = None  # None: derived from the contract
    max_prompt_tokens: int = 8192  # sizes the derived message limit (KV of the longest prompt)
    grace_s: float = 5.0
    workers: int = 64  # concurrent streams the server can hold


class DecodeServicer(pdspec_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: DecodeEngine, receiver: Receiver, metrics: NodeMetrics, info: pdspec_pb2.NodeInfo):
        self.engine = engine
        self.receiver = receiver
        self.metrics = metrics
        self.info = info

    def GetInfo(self, request, context):
        return self.info

    def Decode(self, request: pdspec_pb2.DecodeRequest, context: grpc.ServicerContext):
        started = time.monotonic()
        outcome = ["OK"]
        try:
            yield from self._decode(request, context, started, outcome)
        finally:
            self.metrics.finish_request(started, outcome[0])

    def _decode(self, request, context, started: float, outcome: list[str]):
        result = validate_decode_request(request, self.receiver)
        if not isinstance(result, DecodeInput):
            for violation in result:
                self.metrics.validation_rejections.labels("decode", violation.field).inc()
            outcome[0] = status_code(result).name
            context.abort_with_status(to_grpc_status(result, request.request_id))
        self.metrics.proposal_bytes.labels("decode", ENCODING_LABELS[request.proposal.encoding]).inc(
            request.proposal.ByteSize()
        )
        self.metrics.kv_bytes.labels("decode").inc(sum(len(t.data) for t in request.kv_cache))
        try:
            handle = self.engine.submit(result)
        except QueueFull as err:
            outcome[0] = "RESOURCE_EXHAUSTED"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {request.request_id!r}: queue full ({err})")
        context.add_callback(lambda: self.engine.cancel(handle))  # client cancel or deadline
        first = True
        while True:
            try:
                event: Event = handle.events.get(timeout=0.25)
            except queue.Empty:
                if not context.is_active():
                    self.engine.cancel(handle)
                    outcome[0] = "CANCELLED"
                    return
                continue
            if event.error:
                outcome[0] = "INTERNAL"
                context.abort(grpc.StatusCode.INTERNAL, f"request {request.request_id!r}: {event.error}")
            if first and event.tokens:
                self.metrics.time_to_first_token.labels("decode").observe(time.monotonic() - started)
                first = False
            self.metrics.generated_tokens.labels("decode").inc(len(event.tokens))
            yield _response(request.request_id, event)
            if event.finished:
                return


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
            )
        )
    return response


@dataclass
class RunningDecodeNode:
    server: grpc.Server
    port: int
    metrics: NodeMetrics
    metrics_port: int | None
    engine: DecodeEngine
    health: health.HealthServicer


def node_info(pair: ModelPair, config: DecodeConfig, engine: DecodeEngine) -> pdspec_pb2.NodeInfo:
    contract = pair.contract()
    return pdspec_pb2.NodeInfo(
        role="decode",
        protocol_version=contract.protocol_version,
        contract_fingerprint=contract.fingerprint(),
        target_vocab_size=contract.target_vocab_size,
        draft_vocab_size=contract.draft_vocab_size,
        draft_to_target=list(contract.d2t),
        max_speculative_tokens=config.max_speculative_tokens,
        sampler_backend=getattr(engine.verifier.sampler, "backend", "custom"),
        device=config.device,
        target_model=contract.target_model,
        draft_model=contract.draft_model,
    )


@contextlib.contextmanager
def run_server(
    config: DecodeNodeConfig,
    pair_loader: Callable[[], ModelPair] | None = None,
    engine_factory: Callable[..., DecodeEngine] = DecodeEngine,
) -> Iterator[RunningDecodeNode]:
    """Load the models, start serving; NOT_SERVING is reported until both are done."""
    pair = (pair_loader or (lambda: load_pair(config.corpus, config.target_model, config.draft_model)))()
    contract = pair.contract()
    limit = config.max_message_bytes or max_message_bytes(
        contract, config.engine.max_speculative_tokens, config.max_prompt_tokens
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(config.workers),
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # the prefill node's keepalive pings (how it notices a dead peer within seconds)
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    metrics = NodeMetrics("decode", config.engine.max_speculative_tokens, VALIDATED_FIELDS)
    engine = engine_factory(pair, config.engine, metrics)
    receiver = Receiver(contract, config.engine.max_speculative_tokens, pair.d2t)
    pdspec_pb2_grpc.add_DecodeServiceServicer_to_server(
        DecodeServicer(engine, receiver, metrics, node_info(pair, config.engine, engine)), server
    )
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    metrics_server = metrics.serve(config.metrics_port, config.host) if config.metrics_port is not None else None
    engine.start()
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("decode node serving on %s:%d (message limit %d bytes)", config.host, port, limit)
    try:
        yield RunningDecodeNode(
            server, port, metrics, metrics_server.server_port if metrics_server else None, engine, health_servicer
        )
    finally:
        health_servicer.enter_graceful_shutdown()
        server.stop(config.grace_s).wait()
        engine.stop()
        if metrics_server:
            metrics_server.shutdown()
