"""protos/wire.py against the standard protobuf parser: the same bytes are the same
message both ways (fuzzed shapes, dtypes, presence, unknown fields, field order), payloads
are views of the received buffer, and malformed bytes are refused without raising."""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import pdspec_pb2, wire
from protos.codec import TORCH_DTYPES
from protos.proposal import ProposalEncoding
from protos.validation import DecodeInput, validate_decode_request
from tests.protos.factory import KV_LAYOUT, RECEIVER, valid_request

DataType = pdspec_pb2.TensorPB.DataType
ROOT = Path(__file__).resolve().parents[2]


def unknown_fields(draw) -> bytes:
    """0-3 fields with numbers pdspec.proto does not use, of every wire type it allows."""
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        number = draw(st.integers(1000, 2000))  # far above every number in use (DecodeRequest has 20)
        kind = draw(st.sampled_from([0, 1, 2, 5]))
        if kind == 0:
            out += wire.varint(number << 3) + wire.varint(draw(st.integers(0, 2**64 - 1)))
        elif kind == 1:
            out += wire.varint(number << 3 | 1) + draw(st.binary(min_size=8, max_size=8))
        elif kind == 5:
            out += wire.varint(number << 3 | 5) + draw(st.binary(min_size=4, max_size=4))
        else:
            blob = draw(st.binary(max_size=20))
            out += wire.varint(number << 3 | 2) + wire.varint(len(blob)) + blob
    return out


def field_bytes(message) -> list[bytes]:
    """The message's fields, each serialized on its own (for reordering)."""
    parts = []
    for descriptor, _ in message.ListFields():
        one = type(message)()
        if descriptor.is_repeated:
            getattr(one, descriptor.name).extend(getattr(message, descriptor.name))
        elif descriptor.message_type is not None:
            getattr(one, descriptor.name).CopyFrom(getattr(message, descriptor.name))
        else:
            setattr(one, descriptor.name, getattr(message, descriptor.name))
        parts.append(one.SerializeToString())
    return parts


@st.composite
def tensor_bytes(draw) -> bytes:
    data_type = draw(st.sampled_from(list(TORCH_DTYPES)))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = 1
    for d in shape:
        n *= d
    size = n * TORCH_DTYPES[data_type].itemsize + draw(st.sampled_from([0, 0, 0, -1, 3]))
    pb = pdspec_pb2.TensorPB(
        data_type=data_type, shape=shape, data=draw(st.binary(min_size=max(size, 0), max_size=max(size, 0)))
    )
    parts = [*field_bytes(pb), unknown_fields(draw)]
    draw(st.randoms()).shuffle(parts)
    return b"".join(parts)


def length_field(number: int, content: bytes) -> bytes:
    return wire.varint(number << 3 | 2) + wire.varint(len(content)) + content


@st.composite
def request_bytes(draw) -> bytes:
    """A DecodeRequest's bytes in any field order, with unknown fields anywhere."""
    head = pdspec_pb2.DecodeRequest(
        request_id=draw(st.text(max_size=8)),
        protocol_version=draw(st.integers(0, 3)),
        prompt_token_ids=draw(st.lists(st.integers(-5, 2**31 - 1), max_size=6)),
        first_token_id=draw(st.integers(-(2**31), 2**31 - 1)),
        num_speculative_tokens=draw(st.integers(0, 5)),
    )
    if draw(st.booleans()):
        head.sampling.temperature = draw(st.floats(0, 2, width=32))
    parts = [*field_bytes(head), unknown_fields(draw)]
    if draw(st.booleans()):
        inner = field_bytes(pdspec_pb2.Proposal(encoding=draw(st.integers(0, 3)), token_ids=[1, 2]))
        inner += [length_field(n, draw(tensor_bytes())) for n in (3, 4, 5) if draw(st.booleans())]
        inner.append(unknown_fields(draw))
        draw(st.randoms()).shuffle(inner)
        parts.append(length_field(8, b"".join(inner)))
        if draw(st.booleans()):  # a singular message twice: protobuf merges the two
            parts.append(length_field(8, length_field(3, draw(tensor_bytes()))))
    parts += [length_field(9, draw(tensor_bytes())) for _ in range(draw(st.integers(0, 3)))]
    draw(st.randoms()).shuffle(parts)
    return b"".join(parts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=request_bytes())
def test_same_bytes_same_message_both_ways(data):
    standard = pdspec_pb2.DecodeRequest.FromString(data)
    parsed = wire.parse_decode_request(data)
    assert parsed.error is None
    assert parsed.to_message() == standard
    for path, view in parsed.payloads.items():
        assert view.obj is data  # a view of the received bytes, not a copy
        assert bytes(view) == wire._pb_at(standard, path).data
    # and back: header + payload views re-serialized are read by protobuf as the same message
    again = wire.WireDecodeRequest(parsed.header, dict(parsed.payloads)).SerializeToString()
    assert pdspec_pb2.DecodeRequest.FromString(again) == standard
    if standard.HasField("proposal"):
        assert parsed.proposal_bytes >= 0


@pytest.mark.parametrize("encoding", list(ProposalEncoding))
def test_wire_request_bytes_equal_serialize_to_string_and_validate_the_same(encoding):
    message = valid_request(encoding, k=3, prompt_len=7)
    parsed = wire.parse_decode_request(message.SerializeToString())
    out = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest())
    out.header.CopyFrom(parsed.header)
    for i, spec in enumerate(KV_LAYOUT):
        out.set_tensor(
            f"kv_cache[{i}]", torch.frombuffer(bytearray(parsed.payloads[f"kv_cache[{i}]"]), dtype=spec.dtype)
        )
        out.header.kv_cache[i].shape[:] = message.kv_cache[i].shape
    for path, view in parsed.payloads.items():
        if path.startswith("proposal"):
            out.payloads[path] = view
    assert out.SerializeToString() == message.SerializeToString()  # fields in number order, as protobuf writes
    via_wire = validate_decode_request(parsed.header, RECEIVER, parsed.payloads)
    direct = validate_decode_request(message, RECEIVER)
    assert isinstance(via_wire, DecodeInput) and isinstance(direct, DecodeInput)
    for a, b in zip(via_wire.kv_cache, direct.kv_cache, strict=True):
        assert torch.equal(a, b)


def test_gpu_style_tensors_are_views_and_any_layout_is_made_contiguous():
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    out = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest())
    out.set_tensor("kv_cache[0]", t)
    assert out.payloads["kv_cache[0]"].obj is not None and out.payload_bytes("kv_cache") == 96
    out.set_tensor("kv_cache[1]", t.t())  # not contiguous: copied once into C order
    message = out.to_message()
    assert torch.equal(torch.frombuffer(bytearray(message.kv_cache[1].data), dtype=torch.float32).view(6, 4), t.t())
    assert list(message.kv_cache[1].shape) == [6, 4]


def _standard(data: bytes):
    try:
        return pdspec_pb2.DecodeRequest.FromString(data)
    except DecodeError:
        return None


def test_every_truncation_is_refused_or_read_as_protobuf_reads_it():
    data = valid_request(ProposalEncoding.SPARSE, k=2).SerializeToString()
    for end in range(len(data)):
        cut = data[:end]
        parsed, standard = wire.parse_decode_request(cut), _standard(cut)
        if standard is None:
            assert parsed.error is not None, end
            assert parsed.error.field and parsed.error.actual
        else:
            assert parsed.error is None and parsed.to_message() == standard, end


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x4a", "truncated varint"),  # a tag, no length
        (b"\x4a\xff\xff", "truncated varint"),
        (b"\x08" + b"\xff" * 11, "varint longer than 10 bytes"),
        (b"\x4a\xff\xff\xff\xff\x0f", "past the"),  # a 4 GiB length in 6 bytes
        (b"\x42\x03\x1a\x7f\x00", "past the"),  # proposal.probs longer than the proposal
        (b"\x4b\x00", "wire type 3"),  # a group
        (b"\x4e\x00", "wire type 6"),
        (b"\x00\x00", "field number 0"),
        (b"\x4a\x04\x1a\x09ab", "past the"),  # kv_cache[0].data past the tensor
    ],
)
def test_malformed_bytes_are_refused_without_allocating(data, problem):
    tracemalloc.start()
    parsed = wire.parse_decode_request(data)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert parsed.error is not None and problem in parsed.error.actual
    assert peak < 64 << 10


def test_wrong_wire_type_on_a_known_field_is_an_unknown_field_as_in_protobuf():
    data = b"\x48\x05" + pdspec_pb2.DecodeRequest(request_id="x").SerializeToString()  # kv_cache as a varint
    parsed = wire.parse_decode_request(data)
    assert parsed.error is None and parsed.to_message() == pdspec_pb2.DecodeRequest.FromString(data)
    assert not len(parsed.header.kv_cache)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 3))
def test_garbage_never_raises_and_is_never_read_differently(data, splice):
    good = valid_request(ProposalEncoding.DENSE, k=1).SerializeToString()
    data = [data, good[:30] + data, data + good, good[: len(data)] + data][splice]
    parsed, standard = wire.parse_decode_request(data), _standard(data)
    if parsed.error is None:
        assert standard is not None and parsed.to_message() == standard
    chunk = wire.parse_decode_chunk(data)  # the chunk parser too
    assert chunk.error is not None or chunk.wire_bytes == len(data)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(0, 3))
def test_stream_chunks_reassemble_and_parse_as_protobuf(chunk_bytes, seed):
    message = valid_request(ProposalEncoding.DENSE, k=2, seed=seed, prompt_len=9)
    head = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest())
    head.header.CopyFrom(message)
    head.header.ClearField("kv_cache")
    kv = [torch.randn(spec.shape_for(9)).to(spec.dtype) for spec in KV_LAYOUT]
    chunks = [c.SerializeToString() for c in wire.stream_chunks(head, kv, chunk_bytes)]
    first = wire.parse_decode_chunk(chunks[0])
    assert first.error is None and first.request.to_message() == head.header
    assert [list(pb.shape) for pb in first.manifest] == [list(t.shape) for t in kv]
    assert pdspec_pb2.DecodeChunk.FromString(chunks[0]).request == head.header
    got = [bytearray() for _ in kv]
    for data in chunks[1:]:
        parsed, standard = wire.parse_decode_chunk(data), pdspec_pb2.DecodeChunk.FromString(data)
        assert parsed.error is None and len(parsed.data) <= chunk_bytes
        assert (parsed.kv.tensor_index, parsed.kv.offset, bytes(parsed.data)) == (
            standard.kv.tensor_index,
            standard.kv.offset,
            standard.kv.data,
        )
        assert parsed.kv.offset == len(got[parsed.kv.tensor_index])
        got[parsed.kv.tensor_index] += parsed.data
    for t, raw in zip(kv, got, strict=True):
        assert torch.equal(torch.frombuffer(raw, dtype=t.dtype).view(t.shape), t)


def test_manifest_with_data_is_refused():
    data = length_field(2, pdspec_pb2.TensorPB(data_type=DataType.FP32, shape=[1], data=b"abcd").SerializeToString())
    assert "a manifest carries none" in wire.parse_decode_chunk(data).error.actual


def test_random_field_order_of_a_real_request():
    message = valid_request(ProposalEncoding.SPARSE, k=3)
    parts = [
        b"".join(field_bytes(pdspec_pb2.DecodeRequest(request_id=message.request_id))),
        *(length_field(9, t.SerializeToString()) for t in message.kv_cache),
        length_field(8, message.proposal.SerializeToString()),
    ]
    rest = pdspec_pb2.DecodeRequest()
    rest.CopyFrom(message)
    for name in ("request_id", "kv_cache", "proposal"):
        rest.ClearField(name)
    parts += field_bytes(rest)
    for seed in range(5):
        random.Random(seed).shuffle(parts)
        data = b"".join(parts)
        assert wire.parse_decode_request(data).to_message() == pdspec_pb2.DecodeRequest.FromString(data)


@pytest.mark.parametrize(
    "data",
    [
        bytes([0x8A, 0x80, 0x80, 0x80, 0x80, 0x00, 0x00]),  # field 1 (request_id), its key padded to 6 bytes
        bytes([0xCA, 0x80, 0x80, 0x80, 0x80, 0x00, 0x00]),  # field 9 (a KV tensor, walked here): the same
        bytes([0x4A, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00]),  # field 9 with its length padded to 6 bytes
    ],
    ids=["padded-key", "padded-key-walked", "padded-length-walked"],
)
def test_padded_keys_and_lengths_are_refused_as_protobuf_refuses_them(data):
    with pytest.raises(DecodeError):
        pdspec_pb2.DecodeRequest.FromString(data)
    assert wire.parse_decode_request(data).error is not None
    assert wire.parse_decode_chunk(bytes([0x0A, len(data)]) + data).error is not None


def test_bad_utf8_is_refused_under_the_pure_python_runtime():
    """The pure-Python protobuf runtime raises UnicodeDecodeError, not DecodeError, on a string
    that is not UTF-8: the parser still answers with an error instead of raising in gRPC."""
    import subprocess
    import sys

    code = (
        "from google.protobuf.internal import api_implementation as a; assert a.Type() == 'python';"
        "from protos import wire; r = wire.parse_decode_request(bytes([0x0A, 2, 0xC3, 0x28]));"
        "assert r.error is not None and r.error.field == 'request', r; print('refused')"
    )
    env = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr
