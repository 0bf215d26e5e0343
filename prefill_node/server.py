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
from dataclasses import dataclass, field

import grpc

import pdspec
from engine.paged_lm import kv_pool_bytes, paged_pair
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics, SummaryLogger
from pdspec.modelspec import ModelSpec, backends, model_dtype
from pdspec.serving import NodeShell, pin_torch_threads
from pdspec.tls import GRPC_DEFAULT_MAX_RECEIVE, ClientTls, ServerTls, ServiceGuard, channel, transport_ceiling
from prefill_node.engine import KvTransport, PrefillConfig, PrefillEngine
from prefill_node.service import GenerationService, RequestFailed
from prefill_node.watchdog import StallWatchdog
from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.contract import max_message_bytes
from protos.rpc import DecodeStub
from protos.status import bounded_message, to_grpc_status
from sampling.tree import MAX_TREE_NODES

log = logging.getLogger(__name__)
SERVICE = pdspec_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
# Pings every 2 s, with or without calls and while a stream is open with no data: a peer
# that stops answering them (frozen, unplugged) loses its connection 2 s later. grpcio
# 1.85 times out an unanswered ping only by grpc.http2.ping_timeout_ms (default 1 min):
# the keepalive ping is "cancelled" while another ping (a BDP probe sent after data) is
# outstanding, so keepalive_timeout_ms alone never fires on an open stream.
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A GetInfo of the peer check; past it, a peer not yet known compatible (or not connected) is
# unreachable, while a compatible one whose connection is up is only busy (`DecodePeer._check`).
INFO_TIMEOUT_S = 2.0
# Reconnect attempts at most ~1 s apart however long the peer was gone (gRPC's default
# backoff grows to 120 s), each connect given 2 s.
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 2000),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# What the node reads ahead of its client on a relayed decode stream: a fixed receive window
# per stream (no BDP probing, which grows it to whatever loopback carries: a whole 4,096-token
# stream). The relay takes the next decode message only once its client has taken the last
# (prefill_node/service.py), so a client that stops reading backs its stream up to the decode
# node within this window and the decode node pauses it (--pause-backlog). Messages larger than
# the window still pass: gRPC grants a message the relay waits for the window it needs.
RELAY_WINDOW_BYTES = 1024
RELAY_WINDOW = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", RELAY_WINDOW_BYTES),
]
VALIDATED_FIELDS = (
    "request_id",
    "prompt",
    "prompt_token_ids",
    "sampling.stop_token_ids",
    "sampling.temperature",
    "sampling.top_k",
    "sampling.top_p",
    "sampling.max_new_tokens",
    "sampling.logprobs",
    "num_speculative_tokens",
)


@dataclass(frozen=True)
class PrefillNodeConfig:
    decode_addr: str = "localhost:50052"
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = 9401
    engine: PrefillConfig = field(default_factory=PrefillConfig)
    models: ModelSpec = field(default_factory=ModelSpec)
    max_message_bytes: int | None = None
    peer_check_s: float = 1.0  # while the peer is not compatible; 10x that while it is
    grace_s: float = 5.0
    log_stats_s: float = 10.0  # period of the summary log line (0 = off)
    max_streams: int = 160  # concurrent Generate streams (the worker pool has headroom above it)
    # The OpenAI-compatible HTTP API (prefill_node/http.py): None = off, 0 = any free port.
    # Off by default here (tests and embedders pick their ports); the CLI's default is 8000.
    http_port: int | None = None
    served_model_name: str | None = None  # the API's model id (default: the target's name in the contract)
    api_key: str | None = None  # when set, required as `Authorization: Bearer <key>` on /v1/* and on gRPC
    tls: ServerTls | None = None  # gRPC and HTTP API over TLS; with its `ca`, mTLS on both
    decode_tls: ClientTls | None = None  # how to dial the decode node(s): None = plaintext
    decode_stall_s: float = 3.0  # a relayed decode stream silent this long is cancelled (0 = off)
    http_ready_wait_s: float = 30.0  # an HTTP /v1/* request waits this long for a compatible peer, then 503
    # --peer-token-file: sent as `authorization: Bearer <token>` on every DecodeService call
    # (the decode node's --peer-token-file must hold the same token); None = none sent
    peer_token: str | None = None
    torch_threads: int | None = None  # --torch-threads (resolved); None = torch's own default


class DecodePeer:
    """The channel to the decode node(s) and the watcher of their compatibility."""

    def __init__(
        self, config: PrefillNodeConfig, engine: PrefillEngine, on_change: Callable[[bool], None], limit: int
    ) -> None:
        options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            *KEEPALIVE,
            *RECONNECT,
            *RELAY_WINDOW,
        ]
        if config.decode_addr.startswith("dns:"):
            options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})))
        self.channel = channel(config.decode_addr, config.decode_tls, options, api_key=config.peer_token)
        self.stub = DecodeStub(self.channel)  # the zero-copy codec (protos/wire.py)
        self.engine = engine
        self.config = config
        self.on_change = on_change
        self.compatible = False
        self.problem = "decode peer not checked yet"
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._connectivity: grpc.ChannelConnectivity | None = None
        self._thread = threading.Thread(target=self._watch, name="decode-peer", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.channel.subscribe(self._on_connectivity)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self.channel.unsubscribe(self._on_connectivity)
        self.channel.close()

    def recheck(self) -> None:
        self._wake.set()

    def suspect(self, problem: str) -> None:
        """Not compatible until a check says otherwise (a stalled stream, a lost connection):
        NOT_SERVING now rather than after a GetInfo that may take its whole timeout."""
        if self.compatible:
            self._set(False, f"decode peer {self.config.decode_addr}: {problem} (re-checking)")
        self.recheck()

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        previous, self._connectivity = self._connectivity, state
        if state is grpc.ChannelConnectivity.READY:
            if not self.compatible:
                self.recheck()  # back: check now, not at the next period
        elif previous is grpc.ChannelConnectivity.READY:
            self.suspect(f"connection {state.name}")

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._check()
            self._wake.wait(self.config.peer_check_s * (10 if self.compatible else 1))
            self._wake.clear()

    def _check(self) -> None:
        try:
            info = self.stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=INFO_TIMEOUT_S)
        except grpc.RpcError as err:
            if (
                err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                and self.compatible
                and self._connectivity is grpc.ChannelConnectivity.READY
            ):
                # Busy, not gone: a loaded decode node can answer late while its connection
                # answers the keepalive pings; one that stops answering them loses the
                # connection within KEEPALIVE's 2 s, and `_on_connectivity` suspects it then.
                log.warning("decode peer %s: GetInfo took over %.0f s (busy)", self.config.decode_addr, INFO_TIMEOUT_S)
                return
            self._set(False, f"decode peer {self.config.decode_addr} unreachable: {err.code().name}")
            return
        problem = incompatibility(info, self.engine)
        if problem:
            self._set(False, f"decode peer {self.config.decode_addr} incompatible: {problem}")
            return
        spec = self.engine.config.spec
        self.engine.max_speculative_tokens = min(spec.max_speculative_tokens, info.max_speculative_tokens)
        if info.max_speculative_tokens < spec.max_speculative_tokens:
            log.info(
                "decode peer allows K <= %d (prefill's --max-speculative-tokens %d): using %d",
                info.max_speculative_tokens,
                spec.max_speculative_tokens,
                self.engine.max_speculative_tokens,
            )
        own = spec.candidates(self.engine.trees)
        self.engine.max_draft_candidates = min(own, max(1, info.max_draft_candidates))  # 0: a peer before trees
        self.engine.max_tree_nodes = min(spec.max_tree_nodes, info.max_tree_nodes or MAX_TREE_NODES)
        if info.speculative_method and info.speculative_method != spec.method:
            # Exact too: the decode node verifies whatever it receives, then proposes its own way.
            log.info("speculative method differs: prefill %s, decode %s", spec.method, info.speculative_method)
        if info.draft_law and info.draft_law != spec.draft_law.value:
            # Still exact (every proposal carries its own law), but the two sides draft differently.
            log.warning("draft law differs: prefill %s, decode %s", spec.draft_law.value, info.draft_law)
        self._set(True, "")

    def _set(self, compatible: bool, problem: str) -> None:
        with self._lock:
            if compatible != self.compatible or problem != self.problem:
                (log.info if compatible else log.warning)("decode peer: %s", problem or "compatible")
            changed = compatible != self.compatible
            self.compatible, self.problem = compatible, problem
            if changed:
                self.on_change(compatible)


def incompatibility(info: pdspec_pb2.NodeInfo, engine: PrefillEngine) -> str:
    """Why the decode peer described by `info` cannot take this node's requests ("" = it can),
    saying which value is whose."""
    contract = engine.contract
    if info.protocol_version != contract.protocol_version:
        return f"protocol version: prefill {contract.protocol_version}, decode {info.protocol_version}"
    if engine.config.kv_transport is KvTransport.SHM and contract.kv_layout and not info.accepts_shm_kv:
        return "KV transport: prefill --kv-transport shm, decode started without --accept-shm-kv"
    if info.contract_fingerprint == engine.fingerprint:
        return ""
    mine = {
        "target_model": contract.target_model,
        "draft_model": contract.draft_model,
        "target_vocab_size": contract.target_vocab_size,
        "draft_vocab_size": contract.draft_vocab_size,
        "draft_to_target": list(contract.d2t),
    }
    theirs = {name: getattr(info, name) for name in mine}
    theirs["draft_to_target"] = list(info.draft_to_target)
    differ = [
        f"{name}: prefill {_short(mine[name])}, decode {_short(theirs[name])}"
        for name in mine
        if mine[name] != theirs[name]
    ] or ["KV layout (models, dtype or shapes)"]
    return (
        f"contract fingerprint: prefill {engine.fingerprint}, decode {info.contract_fingerprint} ({'; '.join(differ)})"
    )


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


class PrefillServicer(pdspec_pb2_grpc.PrefillServiceServicer):
    """gRPC front end of the generation service."""

    def __init__(self, service: GenerationService, info: pdspec_pb2.NodeInfo):
        self.service = service
        self.info = info

    def GetInfo(self, request, context):
        return self.info

    def Generate(self, request: pdspec_pb2.GenerateRequest, context: grpc.ServicerContext):
        try:
            yield from self.service.generate(request, context)
        except RequestFailed as err:
            if err.violations:
                context.abort_with_status(to_grpc_status(err.violations, err.request_id))
            context.abort(getattr(grpc.StatusCode, err.code), bounded_message(err.message))


@dataclass
class RunningPrefillNode:
    server: grpc.Server
    port: int
    metrics: NodeMetrics
    metrics_port: int | None
    engine: PrefillEngine
    peer: DecodePeer
    service: GenerationService
    shell: NodeShell
    http_port: int | None = None  # the OpenAI API's port, None when off
    http: object | None = None  # its prefill_node.http.HttpServer (`.api`: the OpenAIApi), None when off


def node_info(engine: PrefillEngine, config: PrefillNodeConfig) -> pdspec_pb2.NodeInfo:
    contract = engine.contract
    limits = config.engine.limits
    return pdspec_pb2.NodeInfo(
        role="prefill",
        protocol_version=contract.protocol_version,
        contract_fingerprint=engine.fingerprint,
        target_vocab_size=contract.target_vocab_size,
        draft_vocab_size=contract.draft_vocab_size,
        draft_to_target=list(contract.d2t),
        sampler_backend="",
        device=config.engine.device,
        target_model=contract.target_model,
        draft_model=contract.draft_model,
        proposal_encoding=config.engine.encoding.value,
        version=pdspec.__version__,
        max_new_tokens_limit=limits.max_new_tokens,
        max_prompt_tokens=limits.max_prompt_tokens,
        dtype=model_dtype(engine.pair),
        backends=json.dumps(backends(engine.pair)),
        # the prefill node has no acceptance to adapt to: it proposes K (or the match)
        **config.engine.spec.info(engine.trees, adaptive=False),
        kv_pool_bytes=kv_pool_bytes(engine.pair),
    )


@contextlib.contextmanager
def run_server(
    config: PrefillNodeConfig, pair_loader: Callable[[], ModelPair] | None = None
) -> Iterator[RunningPrefillNode]:
    pin_torch_threads(config.torch_threads, "prefill")
    config.models.check_memory()
    before = config.models.reserved()
    pair = paged_pair(
        (pair_loader or config.models.load)(),
        config.models.kv_budget(before),
        eager=config.models.enforce_eager,
        attention=config.models.attention_backend,
        capture=config.models.graph_capture(max_k=config.engine.spec.max_speculative_tokens, decode=False),
    )
    metrics = NodeMetrics("prefill", config.engine.spec.max_speculative_tokens, VALIDATED_FIELDS)
    engine = PrefillEngine(pair, config.engine, metrics)
    rows = max(config.engine.spec.max_speculative_tokens, config.engine.spec.max_tree_nodes if engine.trees else 0)
    limit = config.max_message_bytes or max_message_bytes(engine.contract, rows, config.engine.limits.max_prompt_tokens)
    shell = NodeShell(
        SERVICE,
        host=config.host,
        port=config.port,
        streams=config.max_streams,
        # gRPC's receive limit above the guard's (the default 4 MiB): what is between is refused and counted
        options=[("grpc.max_receive_message_length", transport_ceiling(GRPC_DEFAULT_MAX_RECEIVE))],
        metrics=metrics,
        metrics_port=config.metrics_port,
        tls=config.tls,
        interceptors=[
            ServiceGuard(
                SERVICE,
                lambda code: metrics.finish_request(time.monotonic(), code),
                config.api_key,
                max_request_bytes=GRPC_DEFAULT_MAX_RECEIVE,
            )
        ],
    )
    listeners: list[Callable[[bool], None]] = [shell.set_serving]  # told when the peer's state changes
    peer = DecodePeer(config, engine, lambda compatible: [tell(compatible) for tell in listeners], limit)
    watchdog = StallWatchdog(config.decode_stall_s, lambda: peer.suspect("a decode stream stalled"))
    service = GenerationService(engine, peer, metrics, config.max_streams, watchdog)
    info = node_info(engine, config)
    metrics.node_info.info(
        {
            "role": "prefill",
            "version": info.version,
            "target_model": info.target_model,
            "draft_model": info.draft_model,
            "device": info.device,
        }
    )
    metrics.running.labels("prefill").set_function(lambda: service.in_flight)
    pdspec_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(service, info), shell.server)
    summary = SummaryLogger(metrics, config.log_stats_s)
    with contextlib.ExitStack() as stack:
        # The HTTP API listens first: a client that saw the node SERVING (gRPC health or
        # /health, both SERVING only once the peer started below is compatible) finds it open.
        http = None
        if config.http_port is not None and config.http_port >= 0:
            from prefill_node.http import start_http

            http = start_http(
                service,
                config.host,
                config.http_port,
                served_model_name=config.served_model_name,
                api_key=config.api_key,
                max_streams=config.max_streams,
                grace_s=config.grace_s,
                tls=config.tls,
                ready_wait_s=config.http_ready_wait_s,
            )
            stack.callback(http.stop)  # when a later start fails (a no-op after the stop below)
            listeners.append(http.api.peer_changed)  # requests held for the peer look again
            scheme = "http" if config.tls is None else "https"
            log.info("OpenAI-compatible API on %s://%s:%d/v1", scheme, config.host, http.port)
        peer.start()
        stack.callback(peer.stop)
        stack.callback(watchdog.stop)
        shell.start()
        stack.callback(shell.stop, config.grace_s)
        summary.start()
        stack.callback(summary.stop)
        if http is not None:
            stack.callback(http.stop)  # first out: its streams still need the decode peer while they drain
        log.info(
            "prefill node on %s:%d (%s), decode peer %s (%s)",
            config.host,
            shell.port,
            "plaintext" if config.tls is None else "mTLS" if config.tls.mutual else "TLS",
            config.decode_addr,
            ("plaintext" if config.decode_tls is None else "TLS")
            + (", peer token" if config.peer_token else ", no peer token"),
        )
        yield RunningPrefillNode(
            shell.server,
            shell.port,
            metrics,
            shell.metrics_port,
            engine,
            peer,
            service,
            shell,
            http.port if http else None,
            http,
        )
