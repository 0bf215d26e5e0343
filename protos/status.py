"""Validation violations -> a gRPC status with google.rpc BadRequest details (grpcio-status).

Servers call `context.abort_with_status(to_grpc_status(violations, request_id))`; clients
read the details back with `grpc_status.rpc_status.from_call(err)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from protos.validation import Code, Violation

# FAILED_PRECONDITION (incompatible peer) outranks the others, then RESOURCE_EXHAUSTED.
_PRIORITY = (Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED, Code.INVALID_ARGUMENT)


# A client whose deadline fires resets the stream at once, while the server's copy of the
# deadline (computed when the request arrived) runs out a transit time later; a cancel that
# close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.1


def ended_status(context: grpc.ServicerContext) -> str:
    """Why an RPC ended before its stream did: its deadline passed, or the client cancelled."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


def status_code(violations: Sequence[Violation]) -> grpc.StatusCode:
    codes = {v.code for v in violations}
    return getattr(grpc.StatusCode, next(c for c in _PRIORITY if c in codes).value)


# Error text quotes client input cut to this many characters (with the original length), so a
# status never carries an unbounded input: gRPC refuses to send trailing metadata above its
# limit (8 KiB by default) and the client would see RESOURCE_EXHAUSTED instead of the error.
ECHO_CHARS = 64
# Violations listed in a status's details; the count of the rest is in the message.
MAX_DETAILS = 16
MAX_MESSAGE_CHARS = 1024


def bounded(text: str, limit: int = ECHO_CHARS) -> str:
    """`text`, or its first `limit` characters and a note of its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def bounded_message(text: str) -> str:
    """A status message of at most ~MAX_MESSAGE_CHARS characters."""
    return bounded(text, MAX_MESSAGE_CHARS)


def to_grpc_status(violations: Sequence[Violation], request_id: str) -> grpc.Status:
    """One status for all violations: the most severe code, every field in the details (at
    most MAX_DETAILS; each value the client sent cut to ECHO_CHARS characters)."""
    if not violations:
        raise ValueError("violations: expected at least one, got none")
    code = status_code(violations)
    bad_request = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field=bounded(v.field), description=f"expected {bounded(v.expected, 256)}, got {bounded(v.actual)}"
            )
            for v in violations[:MAX_DETAILS]
        ]
    )
    detail = any_pb2.Any()
    detail.Pack(bad_request)
    more = f" (+{len(violations) - 1} more)" if len(violations) > 1 else ""
    first = violations[0]
    shown = f"{bounded(first.field)}: expected {bounded(first.expected, 256)}, got {bounded(first.actual)}"
    message = f"request {bounded(request_id)!r}: {shown}{more}"
    rich = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[detail])
    return rpc_status.to_status(rich)


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) pairs from a failed call's BadRequest details."""
    status = rpc_status.from_call(error)
    if status is None:
        return []
    out = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            out += [(v.field, v.description) for v in bad_request.field_violations]
    return out
