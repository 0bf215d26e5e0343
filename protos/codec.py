"""torch.Tensor <-> TensorPB: little-endian raw bytes in C order (docs/design.md §3).

Decoding checks the declared shape against len(data) with Python integers before
anything is allocated, then makes exactly one copy of the payload. With the upb and C++
protobuf runtimes, reading a bytes field already returns a fresh `bytes` object the
message does not share, so a CPU tensor is a `torch.frombuffer` view of it (that read is
the one copy); for a GPU it is the host-to-device copy of the view. The pure-Python
runtime hands out the message's own object, so there the CPU tensor is a clone.
"""

from __future__ import annotations

import math
import sys
import warnings

import torch
from google.protobuf.internal import api_implementation

from protos import pdspec_pb2

DataType = pdspec_pb2.TensorPB.DataType

TORCH_DTYPES: dict[int, torch.dtype] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.INT32: torch.int32,
    DataType.INT64: torch.int64,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}

_FIELD_READ_COPIES = api_implementation.Type() in ("upb", "cpp")  # pb.data is a private copy

if sys.byteorder != "little":  # raw bytes are little-endian on the wire; every real host is
    raise ImportError("protos.codec needs a little-endian host")


class TensorDecodeError(ValueError):
    """A TensorPB that cannot be decoded; `field` names the offending part ("shape", ...)."""

    def __init__(self, field: str, expected: str, actual: str) -> None:
        super().__init__(f"{field}: expected {expected}, got {actual}")
        self.field, self.expected, self.actual = field, expected, actual


def encode_tensor(tensor: torch.Tensor, out: pdspec_pb2.TensorPB | None = None) -> pdspec_pb2.TensorPB:
    """Any-device, any-layout tensor of a wire dtype -> TensorPB (C-order bytes).

    Pass `out` (e.g. `request.proposal.probs`) to fill a message in place: a payload of
    megabytes is then copied into the message once, with no CopyFrom afterwards.
    """
    if tensor.dtype not in WIRE_DTYPES:
        raise ValueError(f"tensor: expected dtype in {sorted(map(str, WIRE_DTYPES))}, got {tensor.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    out = pdspec_pb2.TensorPB() if out is None else out
    out.data_type = WIRE_DTYPES[tensor.dtype]
    out.shape[:] = list(tensor.shape)
    out.data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return out


def dtype_name(data_type: int) -> str:
    """The enum name, or the raw number for values this version does not know."""
    return DataType.Name(data_type) if data_type in DataType.values() else str(data_type)


def check_tensor(pb: pdspec_pb2.TensorPB) -> None:
    """Raise TensorDecodeError unless the dtype is known, dims are >= 0 and the byte
    length matches the shape. Integer arithmetic on the declared shape: nothing sized by
    the shape is allocated (reading `pb.data` for its length costs one payload copy under
    upb; decode_tensor reads it once and checks that)."""
    _check_declared(pb, len(pb.data))


def decode_tensor(
    pb: pdspec_pb2.TensorPB, device: torch.device | str = "cpu", data: bytes | memoryview | None = None
) -> torch.Tensor:
    """TensorPB -> tensor on `device`, after the checks of check_tensor; one payload copy.

    `data`: the payload when it is not in `pb` (protos/wire.py: a view of the received
    message, which the tensor then shares: no copy on a CPU, one host-to-device copy on
    a GPU). The view is read-only memory: the tensor must not be written in place."""
    shared = data is not None
    if data is None:
        data = pb.data  # under upb/cpp a private copy, the one copy (module doc)
    dtype, shape = _check_declared(pb, len(data))
    if not data:
        return torch.empty(shape, dtype=dtype, device=device)
    with warnings.catch_warnings():  # "not writable": the bytes object is ours alone (see above)
        warnings.simplefilter("ignore", UserWarning)
        view = torch.frombuffer(data, dtype=dtype).view(shape)
    if device != "cpu" and torch.device(device).type != "cpu":
        return view.to(device)
    return view if shared or _FIELD_READ_COPIES else view.clone()


def _check_declared(pb: pdspec_pb2.TensorPB, data_len: int) -> tuple[torch.dtype, tuple[int, ...]]:
    """The tensor's dtype and shape once they agree with `data_len` bytes."""
    dtype = TORCH_DTYPES.get(pb.data_type)
    if dtype is None:
        raise TensorDecodeError("data_type", "one of FP32, FP16, BF16, INT32, INT64", dtype_name(pb.data_type))
    shape = tuple(pb.shape)
    if shape and min(shape) < 0:
        raise TensorDecodeError("shape", "non-negative dims", str(list(shape)))
    expected = math.prod(shape) * dtype.itemsize
    if expected != data_len:
        raise TensorDecodeError("data", f"{expected} bytes for shape {list(shape)}", f"{data_len} bytes")
    return dtype, shape
