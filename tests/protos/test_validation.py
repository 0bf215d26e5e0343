"""One test per row of the docs/design.md §3 validation table, plus fuzzing."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protos.validation as validation
from protos import pdspec_pb2, wire
from protos.codec import encode_tensor
from protos.proposal import ProposalEncoding
from protos.validation import Code, DecodeInput, validate_decode_request
from tests.protos.factory import K_MAX, RECEIVER, VD, VT, valid_request

DENSE, POINT_MASS, SPARSE = (pdspec_pb2.Proposal.DENSE, pdspec_pb2.Proposal.POINT_MASS, pdspec_pb2.Proposal.SPARSE)


def violations(request):
    result = validate_decode_request(request, RECEIVER)
    assert not isinstance(result, DecodeInput), "expected violations"
    return {v.field: v for v in result}


def only(request, field, code=Code.INVALID_ARGUMENT, contains=""):
    found = violations(request)
    assert field in found, found
    assert found[field].code is code
    assert contains in found[field].description, found[field].description
    return found[field]


def set_probs(request, tensor):
    request.proposal.probs.CopyFrom(encode_tensor(tensor))
    return request


@pytest.mark.parametrize("encoding", list(ProposalEncoding))
@pytest.mark.parametrize("k", [0, 1, K_MAX])
def test_valid_requests_pass(encoding, k):
    result = validate_decode_request(valid_request(encoding, k=k), RECEIVER)
    assert isinstance(result, DecodeInput), result
    assert result.num_speculative_tokens == k and len(result.kv_cache) == 2
    assert result.kv_cache[0].shape == (2, 5, 4) and result.kv_cache[1].dtype == torch.bfloat16


def test_protocol_version_differs():
    request = valid_request()
    request.protocol_version = 2
    v = only(request, "protocol_version", Code.FAILED_PRECONDITION)
    assert v.expected == "1" and v.actual == "2"


def test_contract_fingerprint_differs():
    request = valid_request()
    request.contract_fingerprint = "sha256:00"
    v = only(request, "contract_fingerprint", Code.FAILED_PRECONDITION)
    assert v.expected == RECEIVER.contract.fingerprint() and v.actual == "sha256:00"


def test_encoding_unspecified():
    request = valid_request()
    request.proposal.encoding = pdspec_pb2.Proposal.ENCODING_UNSPECIFIED
    only(request, "proposal.encoding", contains="ENCODING_UNSPECIFIED")


def test_dense_without_probs():
    request = valid_request()
    request.proposal.ClearField("probs")
    only(request, "proposal.probs", contains="present with DENSE")


def test_point_mass_with_probs():
    request = valid_request(ProposalEncoding.POINT_MASS)
    set_probs(request, torch.zeros(3, VD))
    only(request, "proposal.probs", contains="absent with POINT_MASS")


def test_sparse_without_its_tensors():
    request = valid_request(ProposalEncoding.SPARSE)
    request.proposal.ClearField("sparse_probs")
    only(request, "proposal.sparse_probs", contains="present with SPARSE")


def test_probs_dtype_not_fp32():
    request = set_probs(valid_request(), torch.full((3, VD), 1 / VD, dtype=torch.float16))
    only(request, "proposal.probs.data_type", contains="expected FP32, got FP16")


def test_probs_rank_not_2():
    request = set_probs(valid_request(), torch.full((3, VD, 1), 1 / VD))
    only(request, "proposal.probs.shape", contains="rank 2")


def test_probs_shape_not_k_by_draft_vocab():
    request = set_probs(valid_request(), torch.full((3, VT), 1 / VT))
    only(request, "proposal.probs.shape", contains=f"expected [3, {VD}], got [3, {VT}]")


def test_data_length_disagrees_with_shape():
    request = valid_request()
    request.proposal.probs.data = request.proposal.probs.data[:-4]
    only(request, "proposal.probs.data", contains=f"{3 * VD * 4} bytes")


def test_negative_dims():
    request = valid_request(ProposalEncoding.SPARSE)
    del request.proposal.sparse_ids.shape[:]
    request.proposal.sparse_ids.shape.extend([3, -2])
    only(request, "proposal.sparse_ids.shape", contains="non-negative")


def test_huge_shape_with_12_bytes_is_rejected_without_allocating():
    request = valid_request(ProposalEncoding.SPARSE)
    request.proposal.sparse_ids.CopyFrom(
        pdspec_pb2.TensorPB(data_type=pdspec_pb2.TensorPB.INT32, shape=[10**9, 10**9], data=b"\0" * 12)
    )
    only(request, "proposal.sparse_ids.data", contains="4000000000000000000 bytes")


@pytest.mark.parametrize(
    ("value", "contains"), [(float("nan"), "NaN or Inf"), (float("inf"), "NaN or Inf"), (-0.25, "probabilities >= 0")]
)
def test_nan_inf_and_negative_probabilities(value, contains):
    probs = torch.full((3, VD), 1 / VD)
    probs[1, 2] = value
    only(set_probs(valid_request(), probs), "proposal.probs", contains=contains)


def test_row_sum_off_by_more_than_tolerance():
    probs = torch.full((3, VD), 1 / VD)
    probs[2] *= 1.002
    only(set_probs(valid_request(), probs), "proposal.probs", contains="row 2 sums to 1.002")
    probs = torch.full((3, VD), 1 / VD)
    probs[2] *= 1.0005  # within 1e-3: accepted
    request = set_probs(valid_request(), probs)
    request.proposal.token_ids[:] = [0, 0, 0]  # target 0 <- draft 1, p > 0
    assert isinstance(validate_decode_request(request, RECEIVER), DecodeInput)


@pytest.mark.parametrize(
    "field", ["prompt_token_ids", "first_token_id", "proposal.token_ids", "sampling.stop_token_ids"]
)
@pytest.mark.parametrize("bad", [-1, VT])
def test_token_id_outside_vocab(field, bad):
    request = valid_request()
    if field == "prompt_token_ids":
        request.prompt_token_ids[1] = bad
    elif field == "first_token_id":
        request.first_token_id = bad
    elif field == "proposal.token_ids":
        request.proposal.token_ids[0] = bad
    else:
        request.sampling.stop_token_ids.append(bad)
    only(request, field, contains=f"ids in [0, {VT}), got {bad}")


def test_sparse_draft_id_outside_draft_vocab():
    request = valid_request(ProposalEncoding.SPARSE)
    ids = torch.frombuffer(bytearray(request.proposal.sparse_ids.data), dtype=torch.int32).clone()
    ids[0] = VD
    request.proposal.sparse_ids.data = ids.numpy().tobytes()
    only(request, "proposal.sparse_ids", contains=f"draft ids in [0, {VD}), got {VD}")


@pytest.mark.parametrize("encoding", [ProposalEncoding.DENSE, ProposalEncoding.SPARSE])
def test_draft_token_outside_its_proposals_support(encoding):
    request = valid_request(encoding)
    request.proposal.token_ids[1] = 4  # no draft id maps to target 4: p = 0 after mapping
    only(request, "proposal.token_ids[1]", contains="4 with p = 0")


def test_k_above_max():
    request = valid_request(k=K_MAX)
    request.num_speculative_tokens = K_MAX + 1
    only(request, "num_speculative_tokens", contains=f"0..{K_MAX}, got {K_MAX + 1}")


def test_len_token_ids_differs_from_k():
    request = valid_request(k=3)
    request.proposal.token_ids.append(0)
    only(request, "proposal.token_ids", contains="3 ids (num_speculative_tokens), got 4 ids")


def test_kv_cache_count_dtype_and_shape():
    request = valid_request()
    del request.kv_cache[1]
    only(request, "kv_cache", contains="2 tensors, got 1 tensors")
    request = valid_request()
    request.kv_cache[0].CopyFrom(encode_tensor(torch.zeros(2, 5, 4, dtype=torch.float32)))
    only(request, "kv_cache[0].data_type", contains="expected FP16, got FP32")
    request = valid_request()
    request.kv_cache[1].CopyFrom(encode_tensor(torch.zeros(2, 6, 4, dtype=torch.bfloat16)))  # prompt has 5
    only(request, "kv_cache[1].shape", contains="expected [2, 5, 4], got [2, 6, 4]")


def shared(request: pdspec_pb2.DecodeRequest) -> pdspec_pb2.DecodeRequest:
    """The request with its KV moved to a shared-memory handle (two tensors of 80 bytes)."""
    for pb in request.kv_cache:
        request.kv_shm.manifest.add(data_type=pb.data_type, shape=pb.shape)
    request.kv_shm.offsets[:] = [0, 96]
    request.kv_shm.lengths[:] = [len(pb.data) for pb in request.kv_cache]
    request.kv_shm.name, request.kv_shm.size = "pdspec-kv-" + "0" * 32, 176
    request.ClearField("kv_cache")
    return request


def test_shared_kv_handle():
    accepting = validation.Receiver.from_contract(RECEIVER.contract, K_MAX, accept_shm_kv=True)
    result = validate_decode_request(shared(valid_request()), accepting)
    assert isinstance(result, DecodeInput) and result.kv_cache == []
    only(shared(valid_request()), "kv_shm", Code.FAILED_PRECONDITION, "without --accept-shm-kv")

    def refused(request, field, contains):
        found = {v.field: v for v in validate_decode_request(request, accepting)}
        assert field in found and contains in found[field].description, found

    for name in ("../etc/passwd", "pdspec-kv-" + "A" * 32, "pdspec-kv-1"):
        request = shared(valid_request())
        request.kv_shm.name = name
        refused(request, "kv_shm.name", "32 lowercase hex digits")
    request = shared(valid_request())
    request.kv_shm.lengths[1] = 81
    refused(request, "kv_shm.lengths[1]", "expected 80 bytes (kv_shm.manifest[1]), got 81")
    request = shared(valid_request())
    request.kv_shm.size = 175
    refused(request, "kv_shm.offsets[1]", "inside kv_shm.size = 175 bytes, got [96, 176)")
    request = shared(valid_request())
    request.kv_shm.offsets[1] = 2**64 - 1  # past any segment, however it wraps
    refused(request, "kv_shm.offsets[1]", "inside kv_shm.size")
    request = shared(valid_request())
    del request.kv_shm.offsets[1]
    refused(request, "kv_shm.offsets", "expected 2 (one per tensor), got 1")
    request = shared(valid_request())
    request.kv_shm.manifest[0].shape[1] = 6
    refused(request, "kv_shm.manifest[0].shape", "expected [2, 5, 4], got [2, 6, 4]")
    request = shared(valid_request())
    request.kv_cache.add()
    refused(request, "kv_cache", "0 tensors with kv_shm")
    streamed = validate_decode_request(shared(valid_request()), accepting, kv_manifest=[])
    assert "kv_shm" in {v.field for v in streamed}  # a DecodeStream brings its KV in chunks


@pytest.mark.parametrize(
    ("field", "value", "contains"),
    [
        ("temperature", -0.5, "a finite value >= 0, got -0.5"),
        ("top_k", -3, ">= 0 (0 disables), got -3"),
        ("top_p", 1.5, "[0, 1]"),
        ("max_new_tokens", -1, "0..4096"),
        ("max_new_tokens", 4097, "limit --max-new-tokens-limit"),
        ("max_new_tokens", 2**31 - 1, "0..4096"),
        ("temperature", math.inf, "a finite value"),
        ("temperature", math.nan, "a finite value"),
        ("logprobs", 6, "0..5"),
    ],
)
def test_sampling_params_out_of_domain(field, value, contains):
    request = valid_request()
    setattr(request.sampling, field, value)
    only(request, f"sampling.{field}", contains=contains)


def test_server_limits_on_prompt_stop_ids_and_request_id():
    request = valid_request(prompt_len=5)
    tight = validation.Receiver(
        RECEIVER.contract, K_MAX, RECEIVER.d2t_map, validation.RequestLimits(max_prompt_tokens=4)
    )
    found = {v.field: v for v in validate_decode_request(request, tight)}
    assert "at most 4 tokens (limit --max-prompt-tokens)" in found["prompt_token_ids"].description
    request = valid_request()
    request.sampling.stop_token_ids.extend([1] * 65)
    only(request, "sampling.stop_token_ids", contains="at most 64 ids, got 65 ids")
    request = valid_request()
    request.request_id = "x" * 257
    only(request, "request_id", contains="at most 256 bytes, got 257 bytes")
    request = valid_request()
    request.request_id = "x" * 256
    request.sampling.stop_token_ids.extend([1] * 64)
    assert isinstance(validate_decode_request(request, RECEIVER), DecodeInput)


def test_decoding_does_not_touch_the_request():
    request = valid_request()
    before = request.SerializeToString()
    validate_decode_request(request, RECEIVER)
    assert request.SerializeToString() == before


# Fuzzing: mutated messages give violations or a DecodeInput, never another exception,
# and wire-driven allocations never exceed the bytes the message carries.

MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "data_type",
                "shape_dim",
                "truncate",
                "extend",
                "value",
                "encoding",
                "k",
                "token",
                "kv_drop",
                "kv_shape",
            ]
        ),
        st.integers(-3, 2**31),
        st.floats(allow_nan=True, allow_infinity=True, width=32),
    ),
    max_size=4,
)


def mutate(request, op, n, x):
    proposal = request.proposal
    tensors = [
        t for t in (proposal.probs, proposal.sparse_ids, proposal.sparse_probs, *request.kv_cache) if t.ByteSize()
    ]
    target = tensors[n % len(tensors)] if tensors else None
    if op == "data_type" and target is not None:
        target.data_type = n % 7
    elif op == "shape_dim" and target is not None and len(target.shape):
        target.shape[n % len(target.shape)] = n % 11 - 3
    elif op == "truncate" and target is not None:
        target.data = target.data[: len(target.data) // 2]
    elif op == "extend" and target is not None:
        target.data = target.data + b"\x01" * (n % 9)
    elif op == "value" and target is not None and len(target.data) >= 4:
        at = (n % (len(target.data) // 4)) * 4
        target.data = (
            target.data[:at] + torch.tensor([x], dtype=torch.float32).numpy().tobytes() + target.data[at + 4 :]
        )
    elif op == "encoding":
        proposal.encoding = n % 5
    elif op == "k":
        request.num_speculative_tokens = n % 9 - 2
    elif op == "token" and len(proposal.token_ids):
        proposal.token_ids[n % len(proposal.token_ids)] = n % 20 - 4
    elif op == "kv_drop" and len(request.kv_cache):
        del request.kv_cache[n % len(request.kv_cache)]
    elif op == "kv_shape" and len(request.kv_cache):
        request.kv_cache[0].shape[1] = n % 8


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    encoding=st.sampled_from(list(ProposalEncoding)),
    k=st.integers(0, K_MAX),
    seed=st.integers(0, 50),
    mutations=MUTATIONS,
)
def test_fuzzed_messages(monkeypatch, encoding, k, seed, mutations):
    request = valid_request(encoding, k=k, seed=seed)
    for op, n, x in mutations:
        mutate(request, op, n, x)
    carried = sum(
        len(t.data)
        for t in (request.proposal.probs, request.proposal.sparse_ids, request.proposal.sparse_probs, *request.kv_cache)
    )
    allocated = []
    real_decode = validation.decode_tensor

    def counting_decode(pb, device="cpu", data=None):
        tensor = real_decode(pb, device, data)
        allocated.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(validation, "decode_tensor", counting_decode)
    result = validate_decode_request(request, RECEIVER)
    assert sum(allocated) <= carried
    # the zero-copy parser (payload views of the received bytes) gives the same verdict
    parsed = wire.parse_decode_request(request.SerializeToString())
    assert parsed.error is None and parsed.to_message() == request
    via_wire = validate_decode_request(parsed.header, RECEIVER, parsed.payloads)
    if isinstance(result, DecodeInput):
        assert isinstance(via_wire, DecodeInput)
        # bit for bit (mutated payloads may hold NaN patterns, which torch.equal never calls equal)
        assert all(
            torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
            for a, b in zip(result.kv_cache, via_wire.kv_cache, strict=True)
        )
        assert (result.proposal.probs is None) == (via_wire.proposal.probs is None)
        assert result.proposal.probs is None or torch.equal(
            result.proposal.probs.view(torch.uint8), via_wire.proposal.probs.contiguous().view(torch.uint8)
        )
    else:
        assert via_wire == result
    if isinstance(result, DecodeInput):
        k = result.num_speculative_tokens
        probs = result.proposal.probs
        assert len(result.proposal.token_ids) == k
        assert probs is None or (probs.shape == (k, VT) and math.isclose(float(probs.sum()), k, abs_tol=1e-2))
    else:
        assert result and all(v.field and v.expected and v.actual for v in result)
    if not mutations:
        assert isinstance(result, DecodeInput)


def test_structured_output_is_checked_at_the_decode_boundary():
    request = valid_request()
    request.structured_output.json_schema = '{"type": "object",  "properties": {"b": {}, "a": {}}}'
    result = validate_decode_request(request, RECEIVER)
    assert isinstance(result, DecodeInput)
    # compact JSON, the key order kept (a schema's grammar emits properties in that order)
    assert result.constraint.value == '{"type":"object","properties":{"b":{},"a":{}}}'
    request.structured_output.json_schema = "[]"
    v = only(request, "structured_output.json_schema", Code.INVALID_ARGUMENT)
    assert v.actual == "list"
    request.structured_output.json_object = False
    only(request, "structured_output.json_object", Code.INVALID_ARGUMENT)
