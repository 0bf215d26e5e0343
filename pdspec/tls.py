"""TLS, mTLS and API keys on pdspec's gRPC channels and servers (grpcio's own credentials).

A node serves TLS with `ServerTls(cert, key)`, and mTLS with `ServerTls(cert, key, ca)`:
then only clients whose certificate that CA signed get through the handshake. A client
dials with `ClientTls(ca, cert, key, server_name)`: `ca` verifies the server (None: the
system's roots), `cert`/`key` are its own certificate for an mTLS server, `server_name`
is the name checked against the server certificate's SAN when the address has another
(`grpc.ssl_target_name_override`). docs/security.md describes the deployment side.
"""

from __future__ import annotations

import argparse
import hmac
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from protos.status import ended_status


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{what}: cannot read {path}: {err}") from err


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (PEM files); `ca` set = require client certificates
    signed by it (mTLS)."""

    cert: Path
    key: Path
    ca: Path | None = None

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        return grpc.ssl_server_credentials(
            [pair], root_certificates=_read(self.ca, "--tls-ca"), require_client_auth=self.mutual
        )

    @staticmethod
    def from_args(cert, key, ca, prefix: str = "--tls") -> ServerTls | None:
        """The flags' ServerTls (None: plaintext); ValueError naming the flag when incomplete."""
        if cert is None and key is None:
            if ca is not None:
                raise ValueError(f"{prefix}-ca: expected {prefix}-cert and {prefix}-key with it (mTLS needs TLS)")
            return None
        if cert is None or key is None:
            raise ValueError(f"{prefix}-cert and {prefix}-key: expected both, got only one")
        return ServerTls(Path(cert), Path(key), None if ca is None else Path(ca))


@dataclass(frozen=True)
class ClientTls:
    """How a client dials a TLS server: `ca` verifies it (None: system roots), `cert`/`key`
    identify the client to an mTLS server, `server_name` overrides the name the server's
    certificate is checked against."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"),
            private_key=_read(self.key, "client key"),
            certificate_chain=_read(self.cert, "client certificate"),
        )

    def options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @staticmethod
    def from_args(ca=None, cert=None, key=None, server_name=None, prefix: str = "--tls") -> ClientTls | None:
        """None (plaintext) when no option is set; ValueError naming the flag when incomplete."""
        if (cert is None) != (key is None):
            raise ValueError(f"{prefix}-cert and {prefix}-key: expected both, got only one")
        if ca is None and cert is None:
            if server_name is not None:
                raise ValueError(f"{prefix}-server-name: expected {prefix}-ca (or a client certificate) with it")
            return None
        path = lambda p: None if p is None else Path(p)  # noqa: E731
        return ClientTls(path(ca), path(cert), path(key), server_name)


def channel(
    target: str, tls: ClientTls | None = None, options: Sequence[tuple[str, object]] = (), api_key: str | None = None
) -> grpc.Channel:
    """A channel to `target`, TLS when `tls` is set, sending `authorization: Bearer <api_key>`
    on every call when `api_key` is set."""
    if tls is None:
        ch = grpc.insecure_channel(target, options=list(options))
    else:
        ch = grpc.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])
    return grpc.intercept_channel(ch, _Metadata((("authorization", f"Bearer {api_key}"),))) if api_key else ch


def add_client_flags(
    parser: argparse.ArgumentParser, add=None, prefix: str = "--tls", what: str = "the server"
) -> None:
    """--tls-ca, --tls-cert, --tls-key, --tls-server-name (`add`: an EnvArgumentParser's add_flag)."""
    add = add or parser.add_argument
    add(f"{prefix}-ca", default=None, help=f"CA certificate (PEM) that verifies {what}; turns TLS on")
    add(f"{prefix}-cert", default=None, help=f"client certificate (PEM), when {what} requires mTLS")
    add(f"{prefix}-key", default=None, help=f"client private key (PEM), when {what} requires mTLS")
    add(
        f"{prefix}-server-name",
        default=None,
        help=f"name to check {what}'s certificate against (default: the address's host)",
    )


class _Metadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (an API key, the peer token) to every call of the channel, of
    every kind (DecodeStream streams its requests)."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = tuple(metadata)

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


# ---------------------------------------------------------------------------- the server side


class Unparseable:
    """What the guarded deserializer returns for bytes that are not a valid request message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class TooLarge:
    """What the guarded deserializer returns for a message above the node's limit."""

    def __init__(self, size: int) -> None:
        self.size = size


# gRPC's own receive limit on a guarded server: this much above the node's message limit, so a
# message a little over it reaches the guard (refused there RESOURCE_EXHAUSTED, and counted)
# while one far over it is refused by gRPC's transport before it is buffered (not counted:
# gRPC ends the call before any Python code sees it). docs/reliability.md.
OVERSIZE_MARGIN_FRACTION = 4  # the ceiling is the limit plus a quarter of it...
OVERSIZE_MARGIN_MIN = 1 << 20  # ...and at least 1 MiB above it
GRPC_DEFAULT_MAX_RECEIVE = 4 << 20  # grpcio's default receive limit
GRPC_ENDS_CALL_S = 0.5  # how long gRPC may take to report the end of a call whose message did not come


def transport_ceiling(limit: int) -> int:
    """gRPC's receive limit for a server whose guard enforces `limit` (bytes)."""
    return min(limit + max(limit // OVERSIZE_MARGIN_FRACTION, OVERSIZE_MARGIN_MIN), (1 << 31) - 1)


class ServiceGuard(grpc.ServerInterceptor):
    """Guards one service's methods (health and reflection stay open):

    * with `token`, a call without metadata `authorization: Bearer <token>` ends
      UNAUTHENTICATED (compared in constant time) before its request is parsed (`what` names
      the token in the error: the API key, the peer token);
    * a request that does not parse ends INVALID_ARGUMENT (grpc would say INTERNAL);
    * with `max_request_bytes`, a request message above it ends RESOURCE_EXHAUSTED (serve with
      gRPC's own limit at `transport_ceiling(max_request_bytes)`, so the guard sees it);
    * a single-request call that ends (deadline, cancel, gRPC's own size limit) before its
      request arrived is counted DEADLINE_EXCEEDED or CANCELLED: single-request methods are
      served as request streams of one message, so the guard runs with the call's context
      before its message is read (gRPC would otherwise drop such a call without running any
      Python code); `uncounted` methods (GetInfo) are counted only when the guard refuses them.

    Refusals the guard answers are counted by `count(code)`, once. A message of a request
    stream (DecodeStream) that is unparseable or too large aborts the call from inside the
    servicer's read of it: the servicer counts that call (with the context's code)."""

    def __init__(
        self,
        service: str,
        count: Callable[[str], None],
        token: str | None = None,
        *,
        what: str = "API key",
        max_request_bytes: int | None = None,
        uncounted: Sequence[str] = ("GetInfo",),
    ) -> None:
        self.prefix = f"/{service}/"
        self.count = count
        self.expected = f"Bearer {token}".encode() if token else None
        self.what = what
        self.max_request_bytes = max_request_bytes
        self.uncounted = {f"{self.prefix}{name}" for name in uncounted}
        self.waiting = 0  # single-request calls waiting for their message
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.prefix):
            return handler
        refused = None
        if self.expected is not None and not self._authorized(handler_call_details.invocation_metadata):
            refused = (grpc.StatusCode.UNAUTHENTICATED, f"missing or invalid {self.what}")
        return self._guarded(handler, refused, counted=method not in self.uncounted)

    def _authorized(self, metadata) -> bool:
        given = next((value for key, value in metadata or () if key == "authorization"), "")
        given = given if isinstance(given, bytes) else given.encode()
        return hmac.compare_digest(given, self.expected)

    def _refuse(self, context, code: grpc.StatusCode, message: str) -> None:
        self.count(code.name)
        context.abort(code, message)

    def _problem(self, request) -> tuple[grpc.StatusCode, str] | None:
        if isinstance(request, TooLarge):
            size, limit = request.size, self.max_request_bytes
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"request message of {size} bytes, above the limit {limit}"
        if isinstance(request, Unparseable):
            return grpc.StatusCode.INVALID_ARGUMENT, f"unparseable request message: {_bounded(str(request.error))}"
        return None

    def _guarded(self, handler, refused: tuple[grpc.StatusCode, str] | None, *, counted: bool):
        kind = _kind(handler)
        parse, behaviour = handler.request_deserializer, getattr(handler, kind)
        limit = self.max_request_bytes

        def safe_parse(data: bytes):
            if refused is not None:
                return None  # the bytes stay unparsed
            if limit is not None and len(data) > limit:
                return TooLarge(len(data))
            try:
                return parse(data) if parse is not None else data
            except Exception as err:  # protobuf's DecodeError (and whatever a parser raises)
                return Unparseable(err)

        if handler.request_streaming:

            def checked(requests, context):
                for request in requests:
                    problem = self._problem(request)
                    if problem is not None:
                        context.abort(*problem)  # raised in the servicer's read: it counts the call
                    yield request

            def streamed(requests, context):
                if refused is not None:
                    self._refuse(context, *refused)
                return behaviour(checked(requests, context), context)

            return handler._replace(request_deserializer=safe_parse, **{kind: streamed})

        def single(requests, context):
            if refused is not None:
                self._refuse(context, *refused)
            with self._lock:
                self.waiting += 1
            try:
                request = next(requests)
            except (StopIteration, grpc.RpcError):
                # No message: the client half-closed without one, or the call ended (deadline,
                # cancel, or a message above gRPC's own limit, which Python never sees and
                # cannot tell from a cancel); gRPC may report the end a moment after the read.
                ended = threading.Event()
                if context.add_callback(ended.set) and not ended.wait(GRPC_ENDS_CALL_S):
                    self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "expected one request message, got none")
                code = ended_status(context)
                if counted:
                    self.count(code)
                context.abort(getattr(grpc.StatusCode, code), "the call ended before its request arrived")
            finally:
                with self._lock:
                    self.waiting -= 1
            problem = self._problem(request)
            if problem is not None:
                self._refuse(context, *problem)
            return behaviour(request, context)

        streaming = "stream_stream" if handler.response_streaming else "stream_unary"
        return handler._replace(
            request_streaming=True, request_deserializer=safe_parse, **{kind: None, streaming: single}
        )


def _bounded(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _kind(handler) -> str:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            return kind
    raise ValueError("a method handler without a behaviour")
