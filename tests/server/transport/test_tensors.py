"""Unit tests for server/transport/tensors.py, the TensorProto <-> NumPy codec.

TensorFlow is the oracle throughout: ``tf.make_tensor_proto`` builds requests the way TF clients do,
``tf.make_ndarray`` reads what the codec writes, and ``tf.as_dtype`` says which DataType a NumPy dtype is.
The hand-built typed-field protos below are themselves checked against ``tf.make_ndarray`` so that the
test's own idea of which field carries which dtype is not taken on trust. The protos the codec refuses are
test_tensor_errors.py's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2

from servex.loader.errors import InvalidArgument
from servex.loader.saved_model import dtype_name
from servex.server.transport import tensors
from tests.support.tensor_protos import NAME, dtype_enum, shaped

BF16 = np.dtype(tf.bfloat16.as_numpy_dtype)
assert BF16 == np.dtype(ml_dtypes.bfloat16)

NUMERIC = [
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.int8),
    np.dtype(np.int16),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint8),
    np.dtype(np.uint16),
    np.dtype(np.uint32),
    np.dtype(np.uint64),
    np.dtype(np.bool_),
    np.dtype(np.float16),
    BF16,
    np.dtype(np.complex64),
    np.dtype(np.complex128),
]
STRING = np.dtype(object)
ALL = [*NUMERIC, STRING]
SHAPES = [(), (1,), (5,), (2, 3), (2, 3, 4), (0, 3), (3, 0)]


def _id(value):
    if isinstance(value, np.dtype):
        return "string" if value == STRING else value.name
    if isinstance(value, tuple):
        return "x".join(map(str, value)) if value else "scalar"
    return None


def _pool(dtype: np.dtype) -> np.ndarray:
    """Values that exercise each dtype's edges (extremes, signed zero, subnormals, inf, NaN, odd bytes)."""
    if dtype == STRING:
        return np.array(
            [b"", b"abc", b"\x00\xff\xfe", "h\u00e9llo w\u00f6rld".encode(), b"x" * 300, b"\n"], dtype=object
        )
    if dtype.kind == "b":
        return np.array([True, False, False, True, True, False, True], dtype=dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([0, 1, info.max, info.min, 42, info.max // 3, info.min // 3, info.max - 1], dtype=dtype)
    if dtype.kind == "c":
        part = ml_dtypes.finfo(np.float32 if dtype.itemsize == 8 else np.float64)
        return np.array(
            [
                complex(1.5, -2),
                complex(0, 0),
                complex(-0.0, 1e-3),
                complex(part.max, -part.max),
                complex(np.inf, 1),
                complex(2, -np.inf),
                complex(part.tiny, 7),
            ],
            dtype=dtype,
        )
    info = ml_dtypes.finfo(dtype)
    return np.array(
        [
            0.0,
            -0.0,
            1.5,
            -2.25,
            float(info.max),
            float(info.smallest_subnormal),
            float(info.tiny),
            np.inf,
            -np.inf,
            np.nan,
            -float(info.max),
        ],
        dtype=dtype,
    )


def _sample(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    pool = _pool(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    return pool[np.arange(n) % len(pool)].reshape(shape)


def assert_same(actual, expected) -> None:
    """Same type, dtype, shape and values, bit for bit (so -0.0, NaN, subnormals and bfloat16 all count)."""
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.dtype == object:
        assert all(type(v) is bytes for v in actual.ravel()), actual
        assert actual.tolist() == expected.tolist()
        return
    if expected.dtype == BF16:  # assert_array_equal does not see bfloat16 NaNs as equal; compare as float32
        np.testing.assert_array_equal(actual.astype(np.float32), expected.astype(np.float32))
    else:
        np.testing.assert_array_equal(actual, expected)
    assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes()


# The test's own statement of TensorProto's typed fields (tensor.proto), independent of
# server/transport/tensors.py.
TYPED_FIELD = {
    "float32": "float_val",
    "float64": "double_val",
    "int8": "int_val",
    "int16": "int_val",
    "int32": "int_val",
    "uint8": "int_val",
    "uint16": "int_val",
    "int64": "int64_val",
    "uint32": "uint32_val",
    "uint64": "uint64_val",
    "bool": "bool_val",
    "float16": "half_val",
    "bfloat16": "half_val",
    "complex64": "scomplex_val",
    "complex128": "dcomplex_val",
    "object": "string_val",
}


def _field_values(flat: np.ndarray) -> list:
    """What goes into the typed field for these values: 16-bit floats as their bit patterns, complex as re, im."""
    if flat.dtype in (np.dtype(np.float16), BF16):
        return flat.view(np.uint16).tolist()
    if flat.dtype.kind == "c":
        return [x for c in flat.tolist() for x in (c.real, c.imag)]
    return flat.tolist()


def _typed_proto(array: np.ndarray, values: np.ndarray | None = None) -> tensor_pb2.TensorProto:
    """A request with ``values`` (default: all of ``array``) in the typed field, shaped like ``array``."""
    flat = (array if values is None else values).ravel()
    proto = shaped(dtype_enum(array.dtype), array.shape)
    getattr(proto, TYPED_FIELD[array.dtype.name]).extend(_field_values(flat))
    return proto


def _content_proto(array: np.ndarray) -> tensor_pb2.TensorProto:
    proto = shaped(dtype_enum(array.dtype), array.shape, tensor_content=array.tobytes())
    return tensor_pb2.TensorProto.FromString(proto.SerializeToString())  # as it arrives off the wire


def _set_fields(proto: tensor_pb2.TensorProto) -> set[str]:
    return {f.name for f, _ in proto.ListFields()} - {"dtype", "tensor_shape"}


# --------------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_decode_what_tf_make_tensor_proto_sends(dtype, shape):
    array = _sample(dtype, shape)
    proto = tf.make_tensor_proto(array)
    got = tensors.to_ndarray(proto, NAME)
    assert_same(got, tf.make_ndarray(proto))
    assert_same(got, array)


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", NUMERIC, ids=_id)
def test_decode_tensor_content(dtype, shape):
    array = _sample(dtype, shape)
    proto = _content_proto(array)
    assert len(proto.tensor_content) == array.size * dtype.itemsize
    got = tensors.to_ndarray(proto, NAME)
    assert_same(got, tf.make_ndarray(proto))
    assert_same(got, array)


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_decode_typed_fields(dtype, shape):
    array = _sample(dtype, shape)
    proto = _typed_proto(array)
    assert not proto.tensor_content
    assert_same(tf.make_ndarray(proto), array)  # the hand-built proto is what TensorFlow means by it
    assert_same(tensors.to_ndarray(proto, NAME), array)


@pytest.mark.parametrize(
    ("dtype_enum", "field", "values", "expected"),
    [
        (
            types_pb2.DT_HALF,
            "half_val",
            [0x3C00, 0xC000, 0x7C00, 0x0001, 0x8000],
            np.array([1.0, -2.0, np.inf, 2.0**-24, -0.0], dtype=np.float16),
        ),
        (
            types_pb2.DT_BFLOAT16,
            "half_val",
            [0x3F80, 0xC040, 0xFF80, 0x0001],
            np.array([1.0, -3.0, -np.inf, 2.0**-133], dtype=BF16),
        ),
        (
            types_pb2.DT_COMPLEX64,
            "scomplex_val",
            [1.0, 2.0, -3.5, 0.25],
            np.array([1 + 2j, -3.5 + 0.25j], dtype=np.complex64),
        ),
        (types_pb2.DT_COMPLEX128, "dcomplex_val", [1e300, -1e-300], np.array([1e300 - 1e-300j], dtype=np.complex128)),
        (types_pb2.DT_UINT8, "int_val", [0, 255, 128], np.array([0, 255, 128], dtype=np.uint8)),
        (types_pb2.DT_UINT16, "int_val", [65535, 1], np.array([65535, 1], dtype=np.uint16)),
        (types_pb2.DT_INT8, "int_val", [-128, 127], np.array([-128, 127], dtype=np.int8)),
        (types_pb2.DT_UINT32, "uint32_val", [2**32 - 1], np.array([2**32 - 1], dtype=np.uint32)),
        (types_pb2.DT_UINT64, "uint64_val", [2**64 - 1, 2**63], np.array([2**64 - 1, 2**63], dtype=np.uint64)),
        (types_pb2.DT_INT64, "int64_val", [-(2**63), 2**63 - 1], np.array([-(2**63), 2**63 - 1], dtype=np.int64)),
    ],
    ids=[
        "half-bits",
        "bfloat16-bits",
        "complex64-interleaved",
        "complex128-interleaved",
        "uint8-in-int_val",
        "uint16-in-int_val",
        "int8-in-int_val",
        "uint32-max",
        "uint64-max",
        "int64-extremes",
    ],
)
def test_decode_typed_field_encodings(dtype_enum, field, values, expected):
    proto = shaped(dtype_enum, expected.shape, **{field: values})
    assert_same(tf.make_ndarray(proto), expected)
    assert_same(tensors.to_ndarray(proto, NAME), expected)


@pytest.mark.parametrize("dtype", NUMERIC, ids=_id)
def test_decode_prefers_tensor_content_over_typed_fields(dtype):
    array = _sample(dtype, (2, 3))
    proto = _content_proto(array)
    getattr(proto, TYPED_FIELD[dtype.name]).extend(_field_values(_sample(dtype, (7,))[::-1]))
    assert_same(tf.make_ndarray(proto), array)
    assert_same(tensors.to_ndarray(proto, NAME), array)


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4)], ids=_id)
@pytest.mark.parametrize("dtype", NUMERIC, ids=_id)
def test_decode_tensor_content_is_zero_copy_and_read_only(dtype, shape):
    array = _sample(dtype, shape)
    proto = _content_proto(array)
    got = tensors.to_ndarray(proto, NAME)
    assert_same(got, array)
    assert not got.flags.owndata
    assert not got.flags.writeable
    base = got
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, bytes)  # a view over the message's bytes, not a copy into a new buffer
    assert base == proto.tensor_content
    with pytest.raises(ValueError):
        got[...] = got


# -------------------------------------------------------------------------------------------------- broadcast


@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_one_typed_value_broadcasts_to_the_shape(dtype):
    one = _pool(dtype)[2:3]
    template = np.empty((2, 3), dtype=dtype)
    proto = _typed_proto(template, one)
    expected = np.full((2, 3), one[0], dtype=dtype)
    assert_same(tf.make_ndarray(proto), expected)
    assert_same(tensors.to_ndarray(proto, NAME), expected)


@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_fewer_typed_values_pad_with_the_last(dtype):
    two = _pool(dtype)[1:3]
    proto = _typed_proto(np.empty((4,), dtype=dtype), two)
    expected = np.array([two[0], two[1], two[1], two[1]], dtype=dtype)
    assert_same(tf.make_ndarray(proto), expected)
    assert_same(tensors.to_ndarray(proto, NAME), expected)


def test_broadcast_literal_values():
    proto = shaped(types_pb2.DT_FLOAT, [2, 3], float_val=[7.5])
    np.testing.assert_array_equal(tensors.to_ndarray(proto, NAME), np.full((2, 3), 7.5, dtype=np.float32))
    proto = shaped(types_pb2.DT_INT32, [4], int_val=[1, 2])
    np.testing.assert_array_equal(tensors.to_ndarray(proto, NAME), np.array([1, 2, 2, 2], dtype=np.int32))
    proto = shaped(types_pb2.DT_STRING, [], string_val=[b"only"])
    assert tensors.to_ndarray(proto, NAME).tolist() == b"only"


# --------------------------------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_encode_typed_fields_by_default(dtype, shape):
    array = _sample(dtype, shape)
    proto = tensors.from_ndarray(array)
    assert proto.dtype == dtype_enum(dtype)
    assert [d.size for d in proto.tensor_shape.dim] == list(shape)
    assert not proto.tensor_shape.unknown_rank
    assert not proto.tensor_content
    field = TYPED_FIELD[dtype.name]
    assert _set_fields(proto) == ({field} if array.size else set())
    assert len(getattr(proto, field)) == array.size * (2 if dtype.kind == "c" else 1)
    assert_same(tf.make_ndarray(proto), array)


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", NUMERIC, ids=_id)
def test_encode_tensor_content_when_asked(dtype, shape):
    array = _sample(dtype, shape)
    proto = tensors.from_ndarray(array, tensor_content=True)
    assert proto.dtype == dtype_enum(dtype)
    assert [d.size for d in proto.tensor_shape.dim] == list(shape)
    assert _set_fields(proto) == ({"tensor_content"} if array.size else set())
    assert proto.tensor_content == array.tobytes()
    assert_same(tf.make_ndarray(proto), array)


@pytest.mark.parametrize("tensor_content", [False, True], ids=["typed", "content"])
@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_fill_proto_writes_into_a_given_message(dtype, tensor_content):
    array = _sample(dtype, (3, 2))
    proto = tensor_pb2.TensorProto()
    assert tensors.fill_proto(proto, array, tensor_content) is None
    assert proto == tensors.from_ndarray(array, tensor_content)
    assert_same(tf.make_ndarray(proto), array)


@pytest.mark.parametrize("tensor_content", [False, True], ids=["typed", "content"])
@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_encode_non_contiguous_arrays(dtype, tensor_content):
    base = _sample(dtype, (4, 6))
    for view in (base.T, base[::2, 1::2], base[:, ::-1]):
        assert not view.flags.c_contiguous
        proto = tensors.from_ndarray(view, tensor_content)
        expected = np.ascontiguousarray(view)
        assert_same(tf.make_ndarray(proto), expected)
        assert_same(tensors.to_ndarray(proto, NAME), expected)


@pytest.mark.parametrize("tensor_content", [False, True], ids=["typed", "content"])
@pytest.mark.parametrize(
    "array",
    [
        np.array([b"a", b"bc", b"\xff\x00z"], dtype=object),
        np.array([b"a", b"bc", b"\xffz"], dtype=np.bytes_),
        np.array(["a", "bc", "h\u00e9llo", "\u65e5\u672c"], dtype=np.str_),
        np.array(["plain", "\u00fc"], dtype=object),
        np.array([[b"x", b""], [b"yy", b"zzz"]], dtype=object),
        np.array("scalar", dtype=np.str_),
        np.empty((0, 3), dtype=np.str_),
    ],
    ids=["object-bytes", "numpy-bytes", "numpy-str", "object-str", "object-2d", "str-scalar", "str-empty"],
)
def test_encode_strings_use_string_val(array, tensor_content):
    proto = tensors.from_ndarray(array, tensor_content)
    expected = np.empty(array.shape, dtype=object)
    expected.ravel()[:] = [v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel().tolist()]
    assert proto.dtype == types_pb2.DT_STRING
    assert [d.size for d in proto.tensor_shape.dim] == list(array.shape)
    assert not proto.tensor_content  # DT_STRING has no tensor_content encoding, even when asked
    assert _set_fields(proto) == ({"string_val"} if array.size else set())
    assert list(proto.string_val) == expected.ravel().tolist()
    assert_same(tf.make_ndarray(proto), expected)
    assert_same(tensors.to_ndarray(proto, NAME), expected)


def test_from_ndarray_accepts_array_likes():
    proto = tensors.from_ndarray([[1.5, 2.5]])
    assert proto.dtype == types_pb2.DT_DOUBLE and list(proto.double_val) == [1.5, 2.5]
    assert [d.size for d in proto.tensor_shape.dim] == [1, 2]


@pytest.mark.parametrize("dtype", [np.dtype("datetime64[s]"), np.dtype("timedelta64[ms]"), np.dtype("V4")], ids=str)
def test_encode_rejects_dtypes_tensorflow_lacks(dtype):
    with pytest.raises(InvalidArgument) as info:
        tensors.from_ndarray(np.zeros(3, dtype=dtype))
    assert dtype.name in info.value.message


# ------------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("tensor_content", [False, True], ids=["typed", "content"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", ALL, ids=_id)
def test_round_trip(dtype, shape, tensor_content):
    array = _sample(dtype, shape)
    proto = tensors.from_ndarray(array, tensor_content)
    wire = tensor_pb2.TensorProto.FromString(proto.SerializeToString())
    assert_same(tensors.to_ndarray(proto, NAME), array)
    assert_same(tensors.to_ndarray(wire, NAME), array)


# -------------------------------------------------------------------------------------------------- dtype_name


@pytest.mark.parametrize("dtype", NUMERIC, ids=_id)
def test_dtype_name_numeric(dtype):
    expected = types_pb2.DataType.Name(dtype_enum(dtype))
    assert dtype_name(dtype) == expected
    assert dtype_name(dtype.type) == expected  # a scalar type works as well as a dtype


def test_dtype_name_literals():
    assert dtype_name(np.dtype(np.float32)) == "DT_FLOAT"
    assert dtype_name(np.dtype(np.float64)) == "DT_DOUBLE"
    assert dtype_name(np.dtype(np.int64)) == "DT_INT64"
    assert dtype_name(np.dtype(np.float16)) == "DT_HALF"
    assert dtype_name(BF16) == "DT_BFLOAT16"
    assert dtype_name(np.dtype(np.bool_)) == "DT_BOOL"


@pytest.mark.parametrize(
    "dtype",
    [object, np.bytes_, np.str_, "S1", "S17", "U1", "U9", "<U3", ">U3"],
    ids=str,
)
def test_dtype_name_strings(dtype):
    assert dtype_name(np.dtype(dtype)) == "DT_STRING"


@pytest.mark.parametrize("dtype", ["datetime64[s]", "timedelta64[ns]", "V8"])
def test_dtype_name_without_tensorflow_equivalent(dtype):
    assert dtype_name(np.dtype(dtype)) == np.dtype(dtype).name
