import re
import time

import pytest
import torch

from protos import pdspec_pb2
from protos.codec import TensorDecodeError, check_tensor, decode_tensor, encode_tensor

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def sample(dtype, shape):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_round_trip(dtype, shape):
    t = sample(dtype, shape)
    pb = encode_tensor(t)
    assert list(pb.shape) == list(shape) and len(pb.data) == t.numel() * t.element_size()
    back = decode_tensor(pdspec_pb2.TensorPB.FromString(pb.SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input_is_encoded_in_c_order(dtype):
    t = sample(dtype, (4, 6)).T[1:, ::2]
    assert not t.is_contiguous()
    assert torch.equal(decode_tensor(encode_tensor(t)), t)


def test_little_endian_c_order_bytes():
    pb = encode_tensor(torch.tensor([[1, 2], [3, 256]], dtype=torch.int32))
    assert pb.data == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0])
    assert pb.data_type == pdspec_pb2.TensorPB.INT32


def test_decoded_tensor_does_not_alias_the_message():
    pb = encode_tensor(torch.arange(4, dtype=torch.float32))
    t = decode_tensor(pb)
    t += 1
    assert torch.equal(decode_tensor(pb), torch.arange(4, dtype=torch.float32))


def test_unsupported_dtype_to_encode():
    with pytest.raises(ValueError, match="tensor: expected dtype"):
        encode_tensor(torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize(
    ("pb", "field", "message"),
    [
        (pdspec_pb2.TensorPB(data_type=0, shape=[1], data=b"\0" * 4), "data_type", "DATA_TYPE_UNSPECIFIED"),
        (pdspec_pb2.TensorPB(data_type=99, shape=[1], data=b"\0" * 4), "data_type", "got 99"),
        (pdspec_pb2.TensorPB(data_type=1, shape=[2, -1], data=b""), "shape", "non-negative"),
        (pdspec_pb2.TensorPB(data_type=1, shape=[3], data=b"\0" * 8), "data", "12 bytes for shape [3], got 8 bytes"),
    ],
)
def test_bad_tensors(pb, field, message):
    with pytest.raises(TensorDecodeError, match=re.escape(message)) as err:
        decode_tensor(pb)
    assert err.value.field == field


def test_huge_declared_shape_costs_nothing():
    pb = pdspec_pb2.TensorPB(data_type=1, shape=[10**9, 10**9], data=b"\0" * 12)
    start = time.perf_counter()
    with pytest.raises(TensorDecodeError, match="4000000000000000000 bytes"):
        check_tensor(pb)
    assert time.perf_counter() - start < 0.1  # integer arithmetic, nothing allocated
