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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


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


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata (the API key) to every call of the channel."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = tuple(metadata)

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


# ---------------------------------------------------------------------------- the server side


class Unparseable:
    """What the guarded deserializer returns for bytes that are not a valid request message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class ServiceGuard(grpc.ServerInterceptor):
    """Guards one service's methods (health and reflection stay open):

    * with `api_key`, a call without metadata `authorization: Bearer <key>` ends
      UNAUTHENTICATED (compared in constant time) before its request is parsed;
    * a request that does not parse ends INVALID_ARGUMENT (grpc would say INTERNAL);

    both counted by `count(code)`."""

    def __init__(self, service: str, count: Callable[[str], None], api_key: str | None = None) -> None:
        self.prefix = f"/{service}/"
        self.count = count
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        if self.expected is not None and not self._authorized(handler_call_details.invocation_metadata):
            return self._rejecting(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        return self._parsing(handler)

    def _authorized(self, metadata) -> bool:
        given = next((value for key, value in metadata or () if key == "authorization"), "")
        given = given if isinstance(given, bytes) else given.encode()
        return hmac.compare_digest(given, self.expected)

    def _rejecting(self, handler, code: grpc.StatusCode, message: str):
        def reject(request, context):
            self.count(code.name)
            context.abort(code, message)

        kind = _kind(handler)
        return handler._replace(request_deserializer=None, **{kind: reject})  # the bytes stay unparsed

    def _parsing(self, handler):
        kind = _kind(handler)
        parse, behaviour = handler.request_deserializer, getattr(handler, kind)
        if parse is None:
            return handler

        def safe_parse(data: bytes):
            try:
                return parse(data)
            except Exception as err:  # protobuf's DecodeError (and whatever a parser raises)
                return Unparseable(err)

        def guarded(request, context):
            if isinstance(request, Unparseable):
                self.count("INVALID_ARGUMENT")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unparseable request message: {request.error}")
            return behaviour(request, context)

        return handler._replace(request_deserializer=safe_parse, **{kind: guarded})


def _kind(handler) -> str:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            return kind
    raise ValueError("a method handler without a behaviour")
