"""PrefillService over gRPC: prefill, then relay the decode node's stream to the client.

The node reports NOT_SERVING until its models are loaded and its decode peer answered
GetInfo with the same protocol version and contract fingerprint; a watcher re-checks the
peer (often while it is down, now and then while it is up, and at once after a relayed
call failed), so the node never exits for a missing peer and recovers when it returns.
`--decode-addr dns:///decode:50052` with gRPC's round_robin policy spreads requests over
every decode replica the name resolves to.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from models.loader import load_pair
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.contract import max_message_bytes
from protos.status import to_grpc_status

log = logging.getLogger(__name__)
SERVICE = pdspec_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
# Statuses of a relayed decode call that the client sees as they are; the rest (the peer
# died, reset the stream, ...) become UNAVAILABLE.
PASSED_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True)
class PrefillNodeConfig:
    decode_addr: str = "localhost:50052"
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = 9401
    engine: PrefillConfig = field(default_factory=PrefillConfig)
    corpus: Path | None = None
    target_model: Path | None = None  # HF checkpoints (both or neither); default: the built-in pair
    draft_model: Path | None = None
    max_message_bytes: int | None = None
    max_prompt_tokens: int = 8192
    peer_check_s: float = 1.0  # while the peer is not compatible; 10x that while it is
    grace_s: float = 5.0
    workers: int = 64


class DecodePeer:
    """The channel to the decode node(s) and the watcher of their compatibility."""

    def __init__(
        self, config: PrefillNodeConfig, engine: PrefillEngine, on_change: Callable[[bool], None], limit: int
    ) -> None:
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit), *KEEPALIVE]
        if config.decode_addr.startswith("dns:"):
            options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})))
        self.channel = grpc.insecure_channel(config.decode_addr, options=options)
        self.stub = pdspec_pb2_grpc.DecodeServiceStub(self.channel)
        self.engine = engine
        self.config = config
        self.on_change = on_change
        self.compatible = False
        self.problem = "decode peer not checked yet"
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="decode-peer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self.channel.close()

    def recheck(self) -> None:
        self._wake.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._check()
            self._wake.wait(self.config.peer_check_s * (10 if self.compatible else 1))
            self._wake.clear()

    def _check(self) -> None:
        try:
            info = self.stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=2)
        except grpc.RpcError as err:
            self._set(False, f"decode peer {self.config.decode_addr} unreachable: {err.code().name}")
            return
        contract = self.engine.contract
        if info.protocol_version != contract.protocol_version or info.contract_fingerprint != self.engine.fingerprint:
            self._set(
                False,
                f"decode peer incompatible: protocol {info.protocol_version} vs "
                f"{contract.protocol_version}, fingerprint {info.contract_fingerprint} vs "
                f"{self.engine.fingerprint}",
            )
            return
        self.engine.max_speculative_tokens = min(self.engine.config.max_speculative_tokens, info.max_speculative_tokens)
        self._set(True, "")

    def _set(self, compatible: bool, problem: str) -> None:
        if compatible != self.compatible or problem != self.problem:
            (log.info if compatible else log.warning)("decode peer: %s", problem or "compatible")
        changed = compatible != self.compatible
        self.compatible, self.problem = compatible, problem
        if changed:
            self.on_change(compatible)


class PrefillServicer(pdspec_pb2_grpc.PrefillServiceServicer):
    def __init__(self, engine: PrefillEngine, peer: DecodePeer, metrics: NodeMetrics, info: pdspec_pb2.NodeInfo):
        self.engine = engine
        self.peer = peer
        self.metrics = metrics
        self.info = info

    def GetInfo(self, request, context):
        return self.info

    def Generate(self, request: pdspec_pb2.GenerateRequest, context: grpc.ServicerContext):
        started = time.monotonic()
        outcome = ["OK"]
        try:
            yield from self._generate(request, context, started, outcome)
        finally:
            self.metrics.finish_request(started, outcome[0])

    def _generate(self, request, context, started: float, outcome: list[str]):
        rid = request.request_id
        violations = self.engine.check(request)
        if violations:
            for violation in violations:
                self.metrics.validation_rejections.labels("prefill", violation.field).inc()
            outcome[0] = "INVALID_ARGUMENT"
            context.abort_with_status(to_grpc_status(violations, rid))
        if not self.peer.compatible:
            outcome[0] = "UNAVAILABLE"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid!r}: {self.peer.problem}")
        prefilled = self.engine.prefill(request)
        detokenizer = self.engine.pair.tokenizer.incremental()
        first = pdspec_pb2.GenerateResponse(
            request_id=rid, token_ids=[prefilled.first_token], text=detokenizer.push([prefilled.first_token])
        )
        self.metrics.time_to_first_token.labels("prefill").observe(time.monotonic() - started)
        self.metrics.generated_tokens.labels("prefill").inc()
        if prefilled.finish_reason:
            first.text += detokenizer.flush()
            first.finished, first.finish_reason = True, prefilled.finish_reason
            first.stats.SetInParent()
            yield first
            return
        yield first
        decode = prefilled.decode_request
        self.metrics.proposal_bytes.labels("prefill", prefilled.encoding.value).inc(decode.proposal.ByteSize())
        self.metrics.kv_bytes.labels("prefill").inc(sum(len(t.data) for t in decode.kv_cache))
        call = self.peer.stub.Decode(decode, timeout=context.time_remaining())
        context.add_callback(call.cancel)  # a client cancel cancels the decode stream
        try:
            for response in call:
                response.text = detokenizer.push(response.token_ids)
                if response.finished:
                    response.text += detokenizer.flush()
                self.metrics.generated_tokens.labels("prefill").inc(len(response.token_ids))
                yield response
        except grpc.RpcError as err:
            if not context.is_active():
                outcome[0] = "CANCELLED"
                return
            code = err.code() if err.code() in PASSED_THROUGH else grpc.StatusCode.UNAVAILABLE
            if code is grpc.StatusCode.UNAVAILABLE:
                self.peer.recheck()
            outcome[0] = code.name
            context.abort(code, f"request {rid!r}: decode node: {err.code().name}: {err.details()}")


@dataclass
class RunningPrefillNode:
    server: grpc.Server
    port: int
    metrics: NodeMetrics
    metrics_port: int | None
    engine: PrefillEngine
    peer: DecodePeer
    health: health.HealthServicer


def node_info(engine: PrefillEngine, config: PrefillNodeConfig) -> pdspec_pb2.NodeInfo:
    contract = engine.contract
    return pdspec_pb2.NodeInfo(
        role="prefill",
        protocol_version=contract.protocol_version,
        contract_fingerprint=engine.fingerprint,
        target_vocab_size=contract.target_vocab_size,
        draft_vocab_size=contract.draft_vocab_size,
        draft_to_target=list(contract.d2t),
        max_speculative_tokens=config.engine.max_speculative_tokens,
        sampler_backend="",
        device="cpu",
        target_model=contract.target_model,
        draft_model=contract.draft_model,
    )


@contextlib.contextmanager
def run_server(
    config: PrefillNodeConfig, pair_loader: Callable[[], ModelPair] | None = None
) -> Iterator[RunningPrefillNode]:
    pair = (pair_loader or (lambda: load_pair(config.corpus, config.target_model, config.draft_model)))()
    engine = PrefillEngine(pair, config.engine)
    limit = config.max_message_bytes or max_message_bytes(
        engine.contract, config.engine.max_speculative_tokens, config.max_prompt_tokens
    )
    server = grpc.server(futures.ThreadPoolExecutor(config.workers))
    health_servicer = health.HealthServicer()

    def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            health_servicer.set(name, status)

    set_health(False)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    metrics = NodeMetrics(
        "prefill",
        config.engine.max_speculative_tokens,
        (
            "prompt",
            "prompt_token_ids",
            "sampling.stop_token_ids",
            "sampling.temperature",
            "sampling.top_k",
            "sampling.top_p",
            "sampling.max_new_tokens",
            "num_speculative_tokens",
        ),
    )
    peer = DecodePeer(config, engine, set_health, limit)
    pdspec_pb2_grpc.add_PrefillServiceServicer_to_server(
        PrefillServicer(engine, peer, metrics, node_info(engine, config)), server
    )
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    metrics_server = metrics.serve(config.metrics_port, config.host) if config.metrics_port is not None else None
    server.start()
    peer.start()
    log.info("prefill node on %s:%d, decode peer %s", config.host, port, config.decode_addr)
    try:
        yield RunningPrefillNode(
            server, port, metrics, metrics_server.server_port if metrics_server else None, engine, peer, health_servicer
        )
    finally:
        health_servicer.enter_graceful_shutdown()
        server.stop(config.grace_s).wait()
        peer.stop()
        if metrics_server:
            metrics_server.shutdown()
