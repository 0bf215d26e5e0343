"""The node start-up shell both nodes share, and running it until SIGINT or SIGTERM."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Sequence

import torch

from pdspec.modelspec import MemoryShareError

log = logging.getLogger(__name__)


def serve_until_signal(server_context: contextlib.AbstractContextManager, role: str) -> None:
    """A device-memory share that does not fit stops the node with its one-line error (exit
    status 1), not a traceback: it is the user's setting, not a bug. Only start-up is in here:
    once serving, the engine fails the requests of a step that runs out of memory."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with server_context:
            freeze_start_up(role)
            # A timed wait, not stop.wait(): the kernel may deliver SIGTERM to any of the node's
            # threads (gRPC, inductor's compile workers, ...), and Python runs the handler only
            # when the main thread runs bytecode; an untimed wait would sleep through it.
            while not stop.wait(SIGNAL_POLL_S):
                pass
    except MemoryShareError as err:
        raise SystemExit(f"pdspec {role} node: error: {err}") from None
    except torch.OutOfMemoryError as err:  # another process took the memory after the check
        first = str(err).splitlines()[0]
        raise SystemExit(
            f"pdspec {role} node: error: out of GPU memory while starting ({first}); "
            "pass a smaller --gpu-memory-utilization or --kv-cache-bytes"
        ) from None


SIGNAL_POLL_S = 0.2


def freeze_start_up(role: str) -> None:
    """Move what start-up left alive (the models' modules, the tokenizer's vocabulary, the
    libraries' state: ~380,000 objects on a CPU node serving SmolLM2) to the collector's
    permanent generation, after collecting start-up's garbage. A full collection otherwise
    walks all of them: ~0.2 s with every stream stalled, each time serving has moved enough
    objects into the oldest generation, the first time soon after start-up (vLLM and SGLang
    freeze theirs too). For a process that serves one node until it exits: what is frozen
    lives as long as the node."""
    gc.collect()
    gc.freeze()
    log.info("%s node: %d start-up objects frozen out of garbage collection", role, gc.get_freeze_count())


def pin_torch_threads(threads: int | None, role: str) -> None:
    """Set torch's intra-op thread count for the process (None: leave it as it is). Call it at
    start-up, before any model work: the OpenMP team of a thread is sized when it first runs
    a parallel op. The engines run model work on one thread each, so the process holds a fixed
    number of OpenMP threads whatever the load (tests/nodes/test_threads.py)."""
    if threads is None:
        return
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    log.info("%s node: torch intra-op threads %d", role, threads)


class NodeShell:
    """What both nodes' gRPC servers share: health (NOT_SERVING until `set_serving`),
    reflection under grpc.reflection.v1 and v1alpha, message limits, a port that fails to
    bind when in use, a worker pool with headroom above the engine's admission limit (so
    pdspec's own limits answer RESOURCE_EXHAUSTED, and health checks and GetInfo always
    find a thread), and the node's /metrics endpoint. `tls` serves TLS (mTLS with its CA);
    `interceptors` see every call (pdspec.tls.ServiceGuard: API keys, unparseable requests)."""

    def __init__(
        self,
        service: str,
        *,
        host: str,
        port: int,
        streams: int,
        options: Sequence[tuple[str, object]] = (),
        metrics=None,
        metrics_port: int | None = None,
        tls=None,
        interceptors: Sequence = (),
    ) -> None:
        from concurrent import futures

        import grpc
        from grpc_health.v1 import health, health_pb2_grpc

        self.service = service
        # The worker pool's bound and its threads' name prefix ("<prefix>_<n>"): its threads
        # live until the node stops, so a thread count is only meaningful outside it.
        self.pool_threads, self.thread_prefix = streams + HEADROOM_THREADS, service.rsplit(".", 1)[-1]
        self._pool = futures.ThreadPoolExecutor(self.pool_threads, thread_name_prefix=self.thread_prefix)
        self.server = grpc.server(
            self._pool,
            options=[("grpc.so_reuseport", 0), *options],
            interceptors=list(interceptors),
        )
        self.tls = tls
        self.interceptors = tuple(interceptors)
        self.health = health.HealthServicer()
        self.set_serving(False)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.host, self.requested_port = host, port
        self.metrics, self.metrics_port_requested = metrics, metrics_port
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_server = None
        self._serving_threads: list[threading.Thread] = []

    def set_serving(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", self.service):
            self.health.set(name, status)

    def start(self) -> None:
        from grpc_health.v1 import health

        enable_reflection((self.service, health.SERVICE_NAME), self.server)
        try:
            host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
            address = f"{host}:{self.requested_port}"
            if self.tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, self.tls.credentials())
        except RuntimeError as err:  # grpcio raises when the address cannot be bound
            raise OSError(f"cannot listen on {self.host}:{self.requested_port} (is another node there?)") from err
        if self.metrics is not None and self.metrics_port_requested is not None:
            self._metrics_server = self.metrics.serve(self.metrics_port_requested, self.host)
            self.metrics_port = self._metrics_server.server_port
        before = set(threading.enumerate())
        self.server.start()
        self._serving_threads = serving_threads(before)

    def stop(self, grace_s: float) -> None:
        """Drain within `grace_s`, then wait for gRPC's serving thread to end: grpcio sets the
        event server.stop() returns before that (daemon) thread drops the last call it drained,
        callbacks included (a decode request and its tensors). The interpreter must not be
        finalising then: a daemon thread that needs the GIL back after that exits through
        pthread_exit, whose unwinding through torch's tensor deallocation (noexcept C++) aborts
        the process: "terminate called without an active exception", exit status -6."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        for thread in self._serving_threads:
            thread.join(SERVING_THREAD_EXIT_S)
            if thread.is_alive():
                log.warning("gRPC's serving thread %s did not end within %.0f s", thread.name, SERVING_THREAD_EXIT_S)
        # grpcio leaves the worker pool to its owner: its idle threads would live on in a
        # process that stops a node and goes on (an embedding service, a test run). Not joined:
        # a handler still blocked on something the node no longer serves must not hang the stop.
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._metrics_server:
            self._metrics_server.shutdown()


HEADROOM_THREADS = 16  # health checks, GetInfo, reflection and requests refused by admission
# It ends once it has dropped the last call (well under a second); the bound only keeps a
# grpcio whose serving thread lives on from hanging a node's exit.
SERVING_THREAD_EXIT_S = 10.0


def serving_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads grpc.Server.start() started, given those alive before: grpcio polls the
    server's completion queue on one daemon thread running grpc._server._serve (named
    "Thread-N (_serve)"), which it neither names nor exposes. Only threads of that name are
    taken: no other thread started meanwhile (a stream reader, a watcher) is waited for."""
    return [t for t in threading.enumerate() if t not in before and t.name.endswith("(_serve)")]


def enable_reflection(service_names: Sequence[str], server) -> None:
    """Server reflection under both names: newer tools (grpcurl, Postman) ask
    grpc.reflection.v1 first, older ones v1alpha. The two protocols have the same messages
    (only the package differs), so the v1 method is the v1alpha servicer with its bytes."""
    import grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
