"""Property tests of server/transport/tensors.py's TensorProto decoder (tests/support/strategies.py): any request
TensorProto decodes to what TensorFlow makes of it or is refused with INVALID_ARGUMENT (RESOURCE_EXHAUSTED past
--max_message_bytes) naming the input, never another exception, and without memory out of proportion to the
message.

The references: ``tf.make_ndarray`` (Python), and where it refuses a proto, TensorFlow's own ``Tensor::FromProto``
(``tf.io.parse_tensor``, what TensorFlow Serving decodes with), for shapes of up to 4096 elements."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given
from hypothesis import strategies as st
from tensorflow.core.framework import tensor_pb2, types_pb2

from servex.server.transport import tensors
from tests.support.strategies import (
    MIB,
    REFERENCE_ELEMENTS,
    bounded_memory,
    elements,
    examples,
    outcome,
    refused,
    tensor_protos,
)
from tests.support.tensor_protos import NAME, shaped

LIMIT = MIB // 4  # --max_message_bytes for these decodes: a broadcast may make this much from a few bytes
CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")
DT = types_pb2.DataType


def _references(proto: tensor_pb2.TensorProto) -> tuple[np.ndarray | None, np.ndarray | None]:
    """What TensorFlow decodes ``proto`` to: ``tf.make_ndarray``'s array and ``Tensor::FromProto``'s, each None
    where it refuses the proto; both None when its shape is too large to decode here."""
    shape = [d.size for d in proto.tensor_shape.dim]
    if proto.tensor_shape.unknown_rank or len(shape) > 64 or not 0 <= elements(shape) <= REFERENCE_ELEMENTS:
        return None, None
    arrays = []
    for decode in (tf.make_ndarray, _from_proto):
        try:
            arrays.append(decode(proto))
        except Exception:  # noqa: BLE001 - any refusal
            arrays.append(None)
    return arrays[0], arrays[1]


def _from_proto(proto: tensor_pb2.TensorProto) -> np.ndarray:
    value = tf.io.parse_tensor(proto.SerializeToString(), tf.as_dtype(proto.dtype)).numpy()
    return np.asarray(value, dtype=object if proto.dtype == DT.Value("DT_STRING") else None)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape:
        return False
    if got.dtype.kind == "O":  # flat: tolist() of shape [2^58, 0] would make 2^58 empty lists
        return got.reshape(-1).tolist() == want.reshape(-1).tolist()
    return got.dtype == want.dtype and got.tobytes() == want.tobytes()  # bit for bit: NaN payloads, -0.0


def _check(proto: tensor_pb2.TensorProto, result, peak: int) -> None:
    bounded_memory(peak, proto.ByteSize(), allowed=2 * LIMIT)
    if isinstance(result, np.ndarray):
        assert result.shape == tuple(d.size for d in proto.tensor_shape.dim)
        python, cpp = _references(proto)
        if elements(list(result.shape)) <= REFERENCE_ELEMENTS:
            # what TensorFlow Serving decodes with takes it, and servex agrees with both decoders where they take it
            assert cpp is not None, f"servex decodes a proto TensorFlow's FromProto refuses: {proto}"
            assert _same(result, cpp), (result, cpp)
            assert python is None or _same(result, python), (result, python)
    else:
        refused(result, repr(NAME), codes=CODES)


BOOL_BYTE_2 = shaped(DT.Value("DT_BOOL"), [2], tensor_content=b"\x02\x00")


@given(tensor_protos())
@example(BOOL_BYTE_2)
@example(shaped(DT.Value("DT_FLOAT"), [2**20, 2**20], float_val=[1.0]))  # 2^40 elements from 1 value
@example(shaped(DT.Value("DT_STRING"), [2**40], string_val=[b"x"]))
@example(shaped(DT.Value("DT_INT8"), [3], int_val=[300, -129]))  # wraps as TensorFlow's FromProto does
@example(shaped(DT.Value("DT_HALF"), [3], half_val=[70000, -1]))
@example(shaped(DT.Value("DT_COMPLEX64"), [2], scomplex_val=[1.0, 2.0, 3.0]))
@example(shaped(DT.Value("DT_FLOAT"), [0, 2**62], float_val=[]))
@example(shaped(DT.Value("DT_STRING"), [2**58, 0]))  # no element, as TensorFlow takes it
@example(shaped(DT.Value("DT_UINT8"), [2**63 - 1, 2], tensor_content=b"\x00"))
@examples(300)
def test_a_tensor_proto_decodes_as_tensorflow_does_or_is_refused(proto):
    result, peak = outcome(lambda: tensors.to_ndarray(proto, NAME, LIMIT))
    _check(proto, result, peak)


def test_a_bool_byte_other_than_0_or_1_is_refused():
    # TensorFlow's Tensor::FromProto refuses it ("Cannot parse tensor from proto"), and so does TensorFlow
    # Serving: a C++ bool holding 2 is undefined behaviour in every kernel that reads it.
    result, _ = outcome(lambda: tensors.to_ndarray(BOOL_BYTE_2, NAME, LIMIT))
    refused(result, repr(NAME), "DT_BOOL", "tensor_content", "0 or 1")


@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), tensor_protos(), min_size=1, max_size=3))
@examples(100)
def test_a_request_s_tensors_decode_together_as_each_alone(protos):
    # decode_all (every adapter's path): the same arrays as to_ndarray, or a ServingError naming one of them;
    # its broadcasts bounded together by the limit.
    loop = asyncio.new_event_loop()  # made before memory is traced: the decode's own is what is measured
    try:
        result, peak = outcome(lambda: loop.run_until_complete(tensors.decode_all(protos, LIMIT)))
    finally:
        loop.close()
    # the broadcasts (LIMIT together) made twice over at most (filled, then joined to the values sent)
    bounded_memory(peak, sum(p.ByteSize() for p in protos.values()), allowed=3 * LIMIT)
    if isinstance(result, dict):
        assert result.keys() == protos.keys()
        for name, array in result.items():
            alone = tensors.to_ndarray(protos[name], name, LIMIT)
            assert _same(array, alone)
    else:
        assert result.code in CODES and any(repr(name) in result.message for name in protos), result.message


@pytest.mark.parametrize("dims", [[2**40], [2**20, 2**20], [2**62, 2]])
def test_a_tiny_message_claiming_a_huge_shape_allocates_nothing(dims):
    for dtype, field in [("DT_FLOAT", "float_val"), ("DT_INT64", "int64_val"), ("DT_BOOL", "bool_val")]:
        proto = shaped(DT.Value(dtype), dims, **{field: [1]})
        result, peak = outcome(lambda proto=proto: tensors.to_ndarray(proto, NAME, 256 * MIB))
        refused(result, repr(NAME), codes=CODES)
        assert peak < MIB
