"""Violations reach a client as the §3 status with BadRequest details, over real gRPC."""

from concurrent import futures

import grpc
import pytest

from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.status import field_violations, to_grpc_status
from protos.validation import Code, DecodeInput, Violation, validate_decode_request
from tests.protos.factory import RECEIVER, valid_request


class ValidatingDecode(pdspec_pb2_grpc.DecodeServiceServicer):
    """The protocol layer alone behind a real server: validate, then echo the drafts."""

    def Decode(self, request, context):
        result = validate_decode_request(request, RECEIVER)
        if not isinstance(result, DecodeInput):
            context.abort_with_status(to_grpc_status(result, request.request_id))
        yield pdspec_pb2.GenerateResponse(
            request_id=request.request_id, token_ids=result.proposal.token_ids, finished=True
        )


@pytest.fixture(scope="module")
def stub():
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 64 * 1024)])
    pdspec_pb2_grpc.add_DecodeServiceServicer_to_server(ValidatingDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pdspec_pb2_grpc.DecodeServiceStub(channel)
    channel.close()
    server.stop(None)


def call(stub, request):
    return list(stub.Decode(request, timeout=10))


def test_valid_request_streams(stub):
    responses = call(stub, valid_request())
    assert responses[-1].finished and len(responses[-1].token_ids) == 3


def test_invalid_argument_with_field_violations(stub):
    request = valid_request()
    request.proposal.token_ids[0] = -5
    request.sampling.temperature = -1
    with pytest.raises(grpc.RpcError) as err:
        call(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "req-0" in err.value.details()
    fields = dict(field_violations(err.value))
    assert set(fields) == {"proposal.token_ids", "sampling.temperature"}
    assert "got -5" in fields["proposal.token_ids"]
    assert call(stub, valid_request(seed=1))[-1].finished  # still serving


def test_failed_precondition(stub):
    request = valid_request()
    request.contract_fingerprint = "sha256:other"
    with pytest.raises(grpc.RpcError) as err:
        call(stub, request)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(field_violations(err.value))["contract_fingerprint"].endswith("got sha256:other")


def test_message_above_limit_is_resource_exhausted(stub):
    request = valid_request()
    request.kv_cache[0].data = b"\0" * (128 * 1024)
    with pytest.raises(grpc.RpcError) as err:
        call(stub, request)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_status_code_priority():
    violations = [Violation("a", "x", "y"), Violation("b", "x", "y", Code.RESOURCE_EXHAUSTED)]
    assert to_grpc_status(violations, "r").code == grpc.StatusCode.RESOURCE_EXHAUSTED
    violations.append(Violation("c", "x", "y", Code.FAILED_PRECONDITION))
    assert to_grpc_status(violations, "r").code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ValueError, match="violations: expected at least one"):
        to_grpc_status([], "r")
