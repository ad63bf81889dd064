"""Unit tests for server/transport/tensors.py: the TensorProtos the codec refuses, each INVALID_ARGUMENT
naming the input,
what was wrong and what was expected (the helpers and dtype lists are test_tensors.py's)."""

from __future__ import annotations

import numpy as np
import pytest
from tensorflow.core.framework import tensor_pb2, types_pb2

from servex.loader.errors import InvalidArgument
from servex.server.transport import tensors
from tests.support.tensor_protos import NAME, dtype_enum, shaped


def _invalid(proto: tensor_pb2.TensorProto, *substrings: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        tensors.to_ndarray(proto, NAME)
    message = info.value.message
    assert info.value.code == "INVALID_ARGUMENT"
    assert NAME in message, message
    for s in substrings:
        assert s in message, (s, message)
    return message


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes"),
    [
        (np.float32, [2, 3], 20),
        (np.float32, [2, 3], 28),
        (np.int64, [3], 16),
        (np.float16, [5], 9),
        (np.complex128, [], 8),
        (np.bool_, [2, 2], 5),
        (np.uint8, [0, 4], 4),
    ],
)
def test_error_tensor_content_length(dtype, shape, nbytes):
    dtype = np.dtype(dtype)
    proto = shaped(dtype_enum(dtype), shape, tensor_content=b"\x01" * nbytes)
    needed = int(np.prod(shape)) * dtype.itemsize
    assert nbytes != needed
    _invalid(proto, str(nbytes), str(needed), "tensor_content")


@pytest.mark.parametrize(
    ("dtype_enum", "shape", "fields", "sent", "holds"),
    [
        (types_pb2.DT_FLOAT, [2], {"float_val": [1, 2, 3]}, 3, 2),
        (types_pb2.DT_INT32, [], {"int_val": [1, 2]}, 2, 1),
        (types_pb2.DT_STRING, [2, 2], {"string_val": [b"a"] * 5}, 5, 4),
        (types_pb2.DT_COMPLEX64, [2], {"scomplex_val": [1, 2, 3, 4, 5, 6]}, 3, 2),
        (types_pb2.DT_HALF, [1], {"half_val": [1, 2]}, 2, 1),
        (types_pb2.DT_FLOAT, [0, 3], {"float_val": [1]}, 1, 0),
        (types_pb2.DT_BOOL, [3, 0], {"bool_val": [True, False]}, 2, 0),
    ],
)
def test_error_more_typed_values_than_the_shape_holds(dtype_enum, shape, fields, sent, holds):
    proto = shaped(dtype_enum, shape, **fields)
    _invalid(proto, str(sent), str(holds), str(shape))


@pytest.mark.parametrize(
    ("dtype_enum", "shape", "count", "field"),
    [
        (types_pb2.DT_FLOAT, [2, 3], 6, "float_val"),
        (types_pb2.DT_STRING, [], 1, "string_val"),
        (types_pb2.DT_INT8, [7], 7, "int_val"),
        (types_pb2.DT_BFLOAT16, [1, 1], 1, "half_val"),
        (types_pb2.DT_COMPLEX128, [4], 4, "dcomplex_val"),
    ],
)
def test_error_no_values_for_a_non_empty_shape(dtype_enum, shape, count, field):
    _invalid(shaped(dtype_enum, shape), str(count), str(shape), field)


@pytest.mark.parametrize("shape", [[-1], [2, -1], [-3, 4, 5]], ids=str)
def test_error_negative_dimension(shape):
    proto = shaped(types_pb2.DT_FLOAT, shape, float_val=[1.0])
    _invalid(proto, str(min(shape)), "negative")


def test_error_unknown_rank():
    proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[1.0])
    proto.tensor_shape.unknown_rank = True
    _invalid(proto, "unknown_rank")


@pytest.mark.parametrize(
    "dtype_enum",
    [
        types_pb2.DT_RESOURCE,
        types_pb2.DT_VARIANT,
        types_pb2.DT_QINT8,
        types_pb2.DT_QUINT8,
        types_pb2.DT_QINT32,
        types_pb2.DT_FLOAT_REF,
        types_pb2.DT_INVALID,
        types_pb2.DT_FLOAT8_E4M3FN,
        types_pb2.DT_INT4,
    ],
    ids=types_pb2.DataType.Name,
)
def test_error_unsupported_dtype(dtype_enum):
    proto = shaped(dtype_enum, [1], int_val=[1], tensor_content=b"\x00")
    message = _invalid(proto, types_pb2.DataType.Name(dtype_enum), "not supported")
    assert "DT_FLOAT" in message.split("not supported", 1)[1]  # lists what is supported


def test_error_unknown_dtype_number():
    _invalid(shaped(987, [1], int_val=[1]), "987", "not supported")


def test_error_string_in_tensor_content():
    proto = shaped(types_pb2.DT_STRING, [2], tensor_content=b"ab")
    _invalid(proto, "DT_STRING", "tensor_content", "string_val")


@pytest.mark.parametrize(
    ("shape", "fields"),
    [
        ([2**62, 4], {}),
        ([2**32, 2**32], {}),
        ([2**32, 2**32], {"float_val": [1.0]}),
        ([2**62, 4], {"tensor_content": b"\x00" * 4}),
    ],
    ids=["no-values", "no-values-2", "one-value", "content"],
)
def test_error_element_count_overflowing_int64(shape, fields):
    # TensorFlow's TensorShape refuses shapes of more than 2**63 - 1 elements; the codec must answer
    # INVALID_ARGUMENT for them too, not crash with a NumPy error (which the server would report as INTERNAL).
    _invalid(shaped(types_pb2.DT_FLOAT, shape, **fields))


@pytest.mark.parametrize(
    ("dtype_enum", "shape"),
    [(types_pb2.DT_FLOAT, [0, 2**61]), (types_pb2.DT_FLOAT, [0, 2**40, 2**40]), (types_pb2.DT_STRING, [0, 2**60])],
    ids=["float-0x2^61", "float-0x2^40x2^40", "string-0x2^60"],
)
def test_error_empty_shape_too_large_to_describe(dtype_enum, shape):
    # No element, but NumPy still indexes the other dimensions' bytes: past 2^63 it cannot make the array, which
    # must be INVALID_ARGUMENT, not a ValueError the server would answer INTERNAL.
    _invalid(shaped(dtype_enum, shape), "too large")


def test_error_more_dimensions_than_numpy_supports():
    _invalid(shaped(types_pb2.DT_FLOAT, [1] * 65, float_val=[1.0]), "65 dimensions", "at most 64")
    assert tensors.to_ndarray(shaped(types_pb2.DT_FLOAT, [1] * 64, float_val=[1.0]), NAME).shape == (1,) * 64


def test_error_odd_number_of_complex_components():
    # 3 floats cannot be complex pairs; the message must say what was sent, not claim "more than" the shape.
    proto = shaped(types_pb2.DT_COMPLEX64, [2], scomplex_val=[1.0, 2.0, 3.0])
    message = _invalid(proto, "scomplex_val", "3")
    assert "more than" not in message, message
