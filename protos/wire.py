"""Zero-copy wire codec for DecodeRequest and DecodeChunk (the big `bytes data` fields).

Encoding: the small fields (ids, sampling, each TensorPB's data_type and shape) are
serialized by protobuf; every tensor's payload is spliced in as a length-delimited field
from a memoryview of the contiguous host tensor (pinned when it came from a GPU). The
message is a list of buffers joined ONCE into the `bytes` gRPC sends: that join is the
only copy of the payload on the way out. With no unknown fields the bytes are exactly
those of `DecodeRequest.SerializeToString()` (fields in number order).

Decoding walks the protobuf wire format (tags, varints, lengths) of only what the
request needs: every field except the TensorPB `data` fields is handed to the standard
parser (so presence, packed/unpacked repeated fields, unknown fields, repeated
occurrences of a singular message — merged, a later scalar winning — read exactly as
`pdspec_pb2` reads them), and each `data` field becomes a memoryview of the received
buffer in a side table keyed by its path ("proposal.probs", "kv_cache[3]"). Nothing is
allocated by what a length or a shape claims: lengths are checked against the bytes
received while walking, and protos/validation.py checks the declared shapes against the
payload lengths before a tensor view is made. Malformed input (a truncated varint, a
length past the end, field number 0, wire types 3/4/6/7 — groups are not used by
pdspec.proto and are refused) gives a `Parsed*` with `error` set: the servicer answers
INVALID_ARGUMENT, never an exception inside gRPC.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from google.protobuf.message import DecodeError

from common.transfer import Buffer, host_bytes
from protos import pdspec_pb2
from protos.codec import WIRE_DTYPES
from protos.validation import Violation

_LEN = 2
_MAX_FIELD = (1 << 29) - 1
PROPOSAL_TENSORS = (("probs", 3), ("sparse_ids", 4), ("sparse_probs", 5))


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""

    def __init__(self, where: str, problem: str) -> None:
        where = where.strip(".") or "request"
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem

    def violation(self) -> Violation:
        return Violation(self.where, "a well-formed protobuf message", self.problem)


# -- encoding -----------------------------------------------------------------------------
def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64: ten bytes of two's complement, as protobuf writes it
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(number: int, parts: Sequence[Buffer]) -> list[Buffer]:
    return [varint(number << 3 | _LEN) + varint(sum(len(p) for p in parts)), *parts]


def tensor_header(tensor: torch.Tensor, out: pdspec_pb2.TensorPB) -> memoryview:
    """Fill `out`'s data_type and shape (data left empty); return the payload view."""
    if tensor.dtype not in WIRE_DTYPES:
        raise ValueError(f"tensor: expected dtype in {sorted(map(str, WIRE_DTYPES))}, got {tensor.dtype}")
    out.Clear()
    out.data_type = WIRE_DTYPES[tensor.dtype]
    out.shape[:] = list(tensor.shape)
    return host_bytes(tensor)


def _tensor_parts(pb: pdspec_pb2.TensorPB, data: Buffer | None) -> list[Buffer]:
    """A TensorPB's content: its header by protobuf, then the payload (inline data if no view)."""
    if data is None:
        data = pb.data
    if pb.data:
        pb = pdspec_pb2.TensorPB(data_type=pb.data_type, shape=pb.shape)
    head = pb.SerializeToString()
    if not len(data):
        return [head]
    return [head, varint(3 << 3 | _LEN) + varint(len(data)), data]


class WireDecodeRequest:
    """A DecodeRequest whose tensor payloads are views: `header` holds every field, each
    TensorPB there with its data_type and shape; its bytes are `payloads[path]` (a path
    with no entry uses the TensorPB's own `data`)."""

    def __init__(self, header: pdspec_pb2.DecodeRequest, payloads: dict[str, Buffer] | None = None) -> None:
        self.header = header
        self.payloads: dict[str, Buffer] = payloads or {}

    def set_tensor(self, path: str, tensor: torch.Tensor) -> None:
        """Ship `tensor` at "proposal.probs" / "proposal.sparse_ids" / ... / "kv_cache[i]"."""
        if path.startswith("kv_cache["):
            index = int(path[len("kv_cache[") : -1])
            while len(self.header.kv_cache) <= index:
                self.header.kv_cache.add()
            pb = self.header.kv_cache[index]
        else:
            pb = getattr(self.header.proposal, path.removeprefix("proposal."))
        self.payloads[path] = tensor_header(tensor, pb)

    def buffers(self) -> list[Buffer]:
        header = self.header
        top = pdspec_pb2.DecodeRequest()
        top.CopyFrom(header)
        top.ClearField("proposal")
        top.ClearField("kv_cache")
        late = [f.name for f, _ in header.ListFields() if f.number > 9]  # written after kv_cache
        for name in late:
            top.ClearField(name)
        parts: list[Buffer] = [top.SerializeToString()]
        if header.HasField("proposal"):
            proposal = header.proposal
            head = pdspec_pb2.Proposal()
            head.CopyFrom(proposal)
            inner: list[Buffer] = []
            for name, number in PROPOSAL_TENSORS:
                head.ClearField(name)
                if proposal.HasField(name):
                    inner += _len_field(
                        number, _tensor_parts(getattr(proposal, name), self.payloads.get(f"proposal.{name}"))
                    )
            parts += _len_field(8, [head.SerializeToString(), *inner])
        for i, pb in enumerate(header.kv_cache):
            parts += _len_field(9, _tensor_parts(pb, self.payloads.get(f"kv_cache[{i}]")))
        if late:  # so the bytes stay in field-number order
            tail = pdspec_pb2.DecodeRequest()
            tail.CopyFrom(header)
            for f, _ in tail.ListFields():
                if f.number <= 9:
                    tail.ClearField(f.name)
            parts.append(tail.SerializeToString())
        return parts

    def SerializeToString(self) -> bytes:
        return b"".join(self.buffers())

    def to_message(self) -> pdspec_pb2.DecodeRequest:
        """The standard message (parsed from the wire bytes): for tests and tools."""
        return pdspec_pb2.DecodeRequest.FromString(self.SerializeToString())

    @property
    def request_id(self) -> str:
        return self.header.request_id

    def payload_bytes(self, prefix: str) -> int:
        own = {f"proposal.{n}": getattr(self.header.proposal, n) for n, _ in PROPOSAL_TENSORS}
        own |= {f"kv_cache[{i}]": pb for i, pb in enumerate(self.header.kv_cache)}
        return sum(len(self.payloads.get(p, pb.data)) for p, pb in own.items() if p.startswith(prefix))


@dataclass
class KvChunkOut:
    """One DecodeChunk carrying bytes [offset, offset + len(data)) of KV tensor `index`."""

    index: int
    offset: int
    data: Buffer

    def buffers(self) -> list[Buffer]:
        head = pdspec_pb2.KvChunk(tensor_index=self.index, offset=self.offset).SerializeToString()
        inner = [head, varint(3 << 3 | _LEN) + varint(len(self.data)), self.data] if len(self.data) else [head]
        return _len_field(3, inner)

    def SerializeToString(self) -> bytes:
        return b"".join(self.buffers())


@dataclass
class HeaderChunkOut:
    """The first DecodeChunk: the request (kv_cache empty) and the KV manifest; with
    `proposal_follows`, the request without first token and proposal. Also the last chunk
    of such a stream: a request of those two fields and no manifest."""

    request: WireDecodeRequest
    manifest: Sequence[pdspec_pb2.TensorPB]
    proposal_follows: bool = False

    def SerializeToString(self) -> bytes:
        parts = _len_field(1, self.request.buffers())
        for pb in self.manifest:
            parts += _len_field(2, [pb.SerializeToString()])
        if self.proposal_follows:
            parts.append(varint(4 << 3) + varint(1))  # field 4, varint: true
        return b"".join(parts)


def kv_manifest(tensors: Iterable[tuple[torch.dtype, Sequence[int]]]) -> list[pdspec_pb2.TensorPB]:
    """A DecodeStream's KV manifest: each tensor's dtype and shape, no data."""
    return [pdspec_pb2.TensorPB(data_type=WIRE_DTYPES[dtype], shape=list(shape)) for dtype, shape in tensors]


def stream_chunks(
    request: WireDecodeRequest, kv: Sequence[torch.Tensor], chunk_bytes: int
) -> Iterator[HeaderChunkOut | KvChunkOut]:
    """The DecodeStream messages of a request: header + manifest, then the KV in slices of
    at most `chunk_bytes`, tensor by tensor (each tensor's bytes viewed when it is reached)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
    yield HeaderChunkOut(request, kv_manifest((t.dtype, t.shape) for t in kv))
    for index, tensor in enumerate(kv):
        view = host_bytes(tensor)
        for offset in range(0, len(view), chunk_bytes):
            yield KvChunkOut(index, offset, view[offset : offset + chunk_bytes])


def layered_chunks(
    header: WireDecodeRequest, manifest: Sequence[pdspec_pb2.TensorPB], sink: queue.Queue, chunk_bytes: int
) -> Iterator[HeaderChunkOut | KvChunkOut]:
    """The DecodeStream messages of a request whose KV is sent as it is computed: the header
    (`proposal_follows`), then each KV tensor in slices as `sink` yields it ((index, copy):
    a common.transfer.HostCopy, waited for here, in the sending thread),
    then the proposal when `sink` yields it (a WireDecodeRequest of first_token_id and
    proposal). `None` from `sink` ends the stream short: the decode node refuses it and frees
    what it reserved."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
    yield HeaderChunkOut(header, manifest, proposal_follows=True)
    while (item := sink.get()) is not None:
        if isinstance(item, WireDecodeRequest):
            yield HeaderChunkOut(item, [])
            return
        index, copy = item
        view = host_bytes(copy.wait())
        for offset in range(0, len(view), chunk_bytes):
            yield KvChunkOut(index, offset, view[offset : offset + chunk_bytes])


def serialize(message) -> bytes:
    """gRPC request_serializer: a pdspec_pb2 message or one of the Wire*/Chunk* objects here."""
    return message.SerializeToString()


# -- decoding -----------------------------------------------------------------------------
def _varint_at(buf: memoryview, pos: int, end: int, where: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError(where, "truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError(where, "varint longer than 10 bytes")


def _fields(buf: memoryview, start: int, end: int, where: str) -> Iterator[tuple[int, int, int, int, int]]:
    """(number, wire type, field start, value start, value end) of each field in [start, end).
    One-byte keys and lengths (nearly every field) are read inline: the walk is per request."""
    pos = start
    while pos < end:
        key = buf[pos]
        value = pos + 1
        if key >= 0x80:
            key, value = _varint_at(buf, pos, end, where)
            if value - pos > 5:  # a padded key: protobuf refuses the message
                raise WireError(where, f"a field key of {value - pos} bytes (at most 5)")
        number, wire_type = key >> 3, key & 7
        if not 1 <= number <= _MAX_FIELD:
            raise WireError(where, f"field number {number}")
        if wire_type == _LEN:
            if value < end and buf[value] < 0x80:
                length, value = buf[value], value + 1
            else:
                at = value
                length, value = _varint_at(buf, value, end, f"{where}.#{number}")
                if value - at > 5:  # a padded length: protobuf refuses the message
                    raise WireError(f"{where}.#{number}", f"a length of {value - at} bytes (at most 5)")
            stop = value + length
        elif wire_type == 0:
            _, stop = _varint_at(buf, value, end, f"{where}.#{number}")
        elif wire_type == 1:
            stop = value + 8
        elif wire_type == 5:
            stop = value + 4
        else:
            raise WireError(where, f"wire type {wire_type} (field {number})")
        if stop > end:
            raise WireError(f"{where}.#{number}", f"{stop - pos} bytes past the {end - pos} left")
        yield number, wire_type, pos, value, stop
        pos = stop


def _split(
    buf: memoryview, segments: Sequence[tuple[int, int]], diverted: set[int], where: str
) -> tuple[Buffer, dict[int, list[tuple[int, int]]]]:
    """The fields of a message given as one or more segments (repeated occurrences of a
    singular message field merge, i.e. concatenate): the bytes of every field not in
    `diverted` (for the standard parser; runs of adjacent fields are one slice), and the
    value ranges of the length-delimited `diverted` ones (a diverted number with another
    wire type is an unknown field to protobuf, so it goes with the rest)."""
    rest: list[memoryview] = []
    found: dict[int, list[tuple[int, int]]] = {n: [] for n in diverted}
    for start, end in segments:
        run = None  # where the current run of kept fields began
        for number, wire_type, at, value, stop in _fields(buf, start, end, where):
            if number in diverted and wire_type == _LEN:
                if run is not None:
                    rest.append(buf[run:at])
                    run = None
                found[number].append((value, stop))
            elif run is None:
                run = at
        if run is not None:
            rest.append(buf[run:end])
    return (rest[0] if len(rest) == 1 else b"".join(rest)), found


def _merge(message, data: Buffer, where: str) -> None:
    try:
        message.MergeFromString(data)
    except (DecodeError, UnicodeDecodeError) as err:  # the pure-Python runtime: bad UTF-8 in a string
        raise WireError(where, f"unparsable ({err})") from err


def _tensor(buf: memoryview, segments, out: pdspec_pb2.TensorPB, where: str) -> memoryview | None:
    out.SetInParent()
    rest, found = _split(buf, segments, {3}, where)
    _merge(out, rest, where)
    if not found[3]:
        return None
    start, stop = found[3][-1]  # a singular bytes field: the last occurrence wins
    return buf[start:stop]


def _request(buf: memoryview, segments, where: str) -> ParsedDecodeRequest:
    header = pdspec_pb2.DecodeRequest()
    rest, found = _split(buf, segments, {8, 9}, where)
    _merge(header, rest, where)
    payloads: dict[str, memoryview] = {}
    if found[8]:
        proposal = header.proposal
        proposal.SetInParent()
        rest, tensors = _split(buf, found[8], {n for _, n in PROPOSAL_TENSORS}, f"{where}proposal")
        _merge(proposal, rest, f"{where}proposal")
        for name, number in PROPOSAL_TENSORS:
            if tensors[number]:
                data = _tensor(buf, tensors[number], getattr(proposal, name), f"{where}proposal.{name}")
                if data is not None:
                    payloads[f"proposal.{name}"] = data
    for i, segment in enumerate(found[9]):
        data = _tensor(buf, [segment], header.kv_cache.add(), f"{where}kv_cache[{i}]")
        if data is not None:
            payloads[f"kv_cache[{i}]"] = data
    proposal_bytes = sum(stop - start for start, stop in found[8])  # the serialized Proposal's length
    return ParsedDecodeRequest(header, payloads, None, len(buf), proposal_bytes)


@dataclass
class ParsedDecodeRequest:
    """A received DecodeRequest: header (TensorPB data empty) + payload views, or `error`."""

    header: pdspec_pb2.DecodeRequest = field(default_factory=pdspec_pb2.DecodeRequest)
    payloads: dict[str, memoryview] = field(default_factory=dict)
    error: Violation | None = None
    wire_bytes: int = 0
    proposal_bytes: int = 0  # the serialized Proposal field's length

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def kv_bytes(self) -> int:
        return sum(len(v) for k, v in self.payloads.items() if k.startswith("kv_cache"))

    def to_message(self) -> pdspec_pb2.DecodeRequest:
        """The full standard message (payloads copied in): for tests."""
        message = pdspec_pb2.DecodeRequest()
        message.CopyFrom(self.header)
        for path, data in self.payloads.items():
            _pb_at(message, path).data = bytes(data)
        return message


def _pb_at(message: pdspec_pb2.DecodeRequest, path: str) -> pdspec_pb2.TensorPB:
    if path.startswith("kv_cache["):
        return message.kv_cache[int(path[len("kv_cache[") : -1])]
    return getattr(message.proposal, path.removeprefix("proposal."))


def parse_decode_request(data: Buffer) -> ParsedDecodeRequest:
    """gRPC request_deserializer of Decode: never raises on bad bytes (see module doc)."""
    buf = memoryview(data)
    try:
        return _request(buf, [(0, len(buf))], "")
    except WireError as err:
        return ParsedDecodeRequest(error=err.violation(), wire_bytes=len(buf))


@dataclass
class ParsedChunk:
    """A received DecodeChunk: the first (request + manifest) or a KV slice, or `error`."""

    request: ParsedDecodeRequest | None = None  # set when the chunk carries a request
    manifest: list[pdspec_pb2.TensorPB] = field(default_factory=list)
    kv: pdspec_pb2.KvChunk | None = None  # tensor_index, offset (data empty)
    data: memoryview = field(default_factory=lambda: memoryview(b""))
    error: Violation | None = None
    wire_bytes: int = 0
    proposal_follows: bool = False


def parse_decode_chunk(data: Buffer) -> ParsedChunk:
    """gRPC request_deserializer of DecodeStream: never raises on bad bytes."""
    buf = memoryview(data)
    try:
        rest, found = _split(buf, [(0, len(buf))], {1, 2, 3}, "chunk.")
        chunk = ParsedChunk(wire_bytes=len(buf))
        scalars = pdspec_pb2.DecodeChunk()
        _merge(scalars, rest, "chunk")  # proposal_follows and unknown fields; still well-formed
        chunk.proposal_follows = scalars.proposal_follows
        if found[1]:
            chunk.request = _request(buf, found[1], "request.")
        for i, segment in enumerate(found[2]):
            pb = pdspec_pb2.TensorPB()
            payload = _tensor(buf, [segment], pb, f"kv_manifest[{i}]")
            if payload is not None and len(payload):
                raise WireError(f"kv_manifest[{i}].data", f"{len(payload)} bytes (a manifest carries none)")
            chunk.manifest.append(pb)
        if found[3]:
            chunk.kv = pdspec_pb2.KvChunk()
            rest, inner = _split(buf, found[3], {3}, "kv")
            _merge(chunk.kv, rest, "kv")
            if inner[3]:
                start, stop = inner[3][-1]
                chunk.data = buf[start:stop]
    except WireError as err:
        return ParsedChunk(error=err.violation(), wire_bytes=len(buf))
    return chunk
