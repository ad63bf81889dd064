"""The REST JSON codecs without a server: JSON values to typed arrays (TensorFlow Serving's checks), arrays to
JSON (float32 shortest decimals, NaN/Infinity), bounded decompression of request bodies."""

from __future__ import annotations

import gzip
import json
import zlib

import ml_dtypes
import numpy as np
import pytest

from loader.errors import InvalidArgument, ServingError
from server import rest_codec as codec
from server.rest import HTTP_STATUS, inflate, status_of

F32 = np.dtype(np.float32)


def to_array(value, dtype=F32):
    return codec.to_array(value, np.dtype(dtype), "inputs", "input 'x'")


def refused(value, dtype=F32) -> str:
    with pytest.raises(InvalidArgument) as e:
        to_array(value, dtype)
    return e.value.message


def test_numbers_become_the_dtype_asked_for():
    out = to_array([[1, 2.5], [3, 4]])
    assert out.dtype == F32 and out.tolist() == [[1.0, 2.5], [3.0, 4.0]]
    assert to_array([1, 2], np.int8).dtype == np.int8
    assert to_array([True, False], np.bool_).tolist() == [True, False]
    assert to_array(7, np.int64).shape == ()
    assert to_array([[], []], np.int32).shape == (2, 0)
    assert to_array([1.5], ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
    assert to_array([2**64 - 1], np.uint64).tolist() == [2**64 - 1]


def test_wrong_types_name_the_position_and_what_was_expected():
    assert 'inputs[1][0] is "a" (string), expected a number' in refused([[1.0], ["a"]])
    assert "inputs[1] is 2.5 (number), expected an integer" in refused([1, 2.5], np.int32)
    assert "inputs[0] is true (boolean), expected a number" in refused([True])
    assert "inputs[1] is 1 (number), expected true or false" in refused([True, 1], np.bool_)
    assert "inputs[1] is null" in refused([1.0, None])
    assert "inputs[0] is {" in refused([{"b64": "AA=="}])


def test_ranges_and_precision():
    assert "inputs[1] is 300, out of range for uint8 (0..255)" in refused([1, 300], np.uint8)
    assert "out of range for uint8" in refused([-1], np.uint8)
    assert "too large for int64" in refused([2**70], np.int64)
    assert "without loss of precision" in refused([16777216])  # TensorFlow Serving: |int| <= 2^24 - 1
    assert to_array([-16777215]).tolist() == [-16777215.0]
    assert "without loss of precision (out of its range)" in refused([1e39])
    assert "complex64 values cannot be given in JSON" in refused([1], np.complex64)


def test_ragged_lists_are_refused_with_where():
    assert "instances" not in refused([[1, 2], [3]])
    assert "inputs[1] has 1 elements where the first list at that depth has 2" in refused([[1, 2], [3]])
    assert "inputs[1] is a scalar" in refused([[1], 2])
    assert "inputs[1][0] is a list of 1" in refused([[1], [[2]]])


def test_parse_accepts_tensorflow_serving_literals_and_reports_errors():
    assert codec.parse(b'{"a": [NaN, Infinity, -Infinity, 1]}')["a"][1:] == [float("inf"), float("-inf"), 1]
    with pytest.raises(InvalidArgument, match="JSON parse error in the request body"):
        codec.parse(b'{"a": [1,')
    with pytest.raises(InvalidArgument, match="empty"):
        codec.parse(b"")


def test_dumps_float32_shortest_and_non_finite_as_tensorflow_serving():
    value = {"y": codec.jsonable(np.array([0.2, 3.0, 1e-7], np.float32))}
    assert json.loads(codec.dumps(value)) == {"y": [0.2, 3.0, 1e-7]}
    assert codec.dumps({"y": codec.jsonable(np.array(2.5, np.float32))}) == b'{"y":2.5}'
    bad = np.array([np.nan, np.inf, -np.inf, 0.2], np.float32)
    assert not codec.finite(bad)
    assert codec.dumps({"y": bad}, all_finite=False) == b'{"y":[NaN,Infinity,-Infinity,0.2]}'
    assert json.loads(codec.dumps({"b": codec.jsonable(np.array([1.5], ml_dtypes.bfloat16))})) == {"b": [1.5]}
    with pytest.raises(InvalidArgument, match="complex64"):
        codec.jsonable(np.zeros(2, np.complex64))


# -- bodies -----------------------------------------------------------------------------------------------


def test_inflate_gzip_and_deflate():
    data = b'{"instances": [1]}' * 10
    assert inflate(gzip.compress(data), "gzip", 1000) == data
    assert inflate(zlib.compress(data), "deflate", 1000) == data


def test_inflate_stops_at_the_limit():
    bomb = gzip.compress(b"\0" * (50 << 20))
    with pytest.raises(ServingError) as e:
        inflate(bomb, "gzip", 1 << 20)
    assert status_of(e.value) == 413 and e.value.code == "RESOURCE_EXHAUSTED"
    assert "inflates to more than the limit of 1048576 bytes" in e.value.message


def test_inflate_refuses_broken_streams():
    data = gzip.compress(b"x" * 100)
    for body, words in ((b"plain", "not valid gzip"), (data[:-10], "truncated"), (data + b"junk", "4 bytes after")):
        with pytest.raises(InvalidArgument, match=words):
            inflate(body, "gzip", 1000)


def test_http_status_is_tensorflow_serving_mapping():
    assert HTTP_STATUS["INVALID_ARGUMENT"] == 400 and HTTP_STATUS["FAILED_PRECONDITION"] == 400
    assert HTTP_STATUS["NOT_FOUND"] == 404 and HTTP_STATUS["RESOURCE_EXHAUSTED"] == 429
    assert HTTP_STATUS["UNAVAILABLE"] == 503 and HTTP_STATUS["DEADLINE_EXCEEDED"] == 504
    assert HTTP_STATUS["UNIMPLEMENTED"] == 501 and HTTP_STATUS["INTERNAL"] == 500
