"""The REST JSON codecs without a server: JSON values to typed arrays (TensorFlow Serving's checks), arrays to
JSON (float32 shortest decimals, NaN/Infinity), bounded decompression of request bodies."""

from __future__ import annotations

import gzip
import json
import zlib

import ml_dtypes
import numpy as np
import pytest

from servex.loader.errors import InvalidArgument, ServingError
from servex.server.transport import json_codec as codec
from servex.server.transport.http import HTTP_STATUS, inflate, status_of

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
    # a float that is not finite is shown as the request spelled it, not as null
    assert "inputs[2] is NaN (number), expected an integer" in refused([1, 2, float("nan")], np.int32)
    assert "inputs[0] is -Infinity (number), expected an integer" in refused([float("-inf")], np.int32)
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


def test_parse_accepts_every_non_finite_spelling_tensorflow_serving_s_rapidjson_reads():
    doc = codec.parse(b'{"a": [Inf, -Inf, -NaN, NaN, Infinity], "Inf": "Inf -NaN \\"Inf"}')
    assert doc["a"][:2] == [float("inf"), float("-inf")] and all(v != v for v in doc["a"][2:4])
    assert doc["Inf"] == 'Inf -NaN "Inf'  # strings stay as they are
    for bad in (b'{"a": [Infx]}', b'{"a": [In]}', b'{"a": [--Inf]}'):
        with pytest.raises(InvalidArgument, match="JSON parse error in the request body"):
            codec.parse(bad)


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


def test_float32_decimals_as_tensorflow_serving_writes_them():
    """json_tensor.cc's WriteDecimal: six significant digits where they read back as the same float32, else nine
    (the shortest decimal would read back as another double: 2.6172838 where TensorFlow Serving says 2.61728382)."""
    f = np.float32
    assert codec.tf_decimal(f(0.5) * f(1.2345678) + f(2)) == 2.61728382
    assert codec.tf_decimal(f(1) / f(3)) == 0.333333343
    assert [codec.tf_decimal(f(v)) for v in (0.1, 0.2, 2.5, 9e6, 3e-5, 1234565.0, -7.0)] == [
        0.1, 0.2, 2.5, 9e6, 3e-5, 1234565.0, -7.0,
    ]  # fmt: skip
    small = np.array([[0.5 * 1.2345678 + 2, np.nan], [np.inf, -0.0]], np.float32)
    out = codec.tf_serving_floats(small)
    assert out.dtype == np.float64 and out.shape == (2, 2)
    assert out[0, 0] == 2.61728382 and np.isnan(out[0, 1]) and out[1, 0] == np.inf and str(out[1, 1]) == "-0.0"
    body = codec.dumps({"y": codec.jsonable(codec.tf_serving_floats(np.full(40, 1 / 3, np.float32)))})
    assert body == b'{"y":[' + b",".join([b"0.333333343"] * 40) + b"]}"


def test_float32_decimals_of_arrays_in_any_memory_order():
    """Values formatted one by one (here past 1e9) land in the answer whatever the array's layout."""
    a = np.full((10, 10), 1.23456789e10, np.float32)
    a[0, 1] = 2.5
    for view in (a, a.T, a[::-1], a[:, ::2], np.asfortranarray(a)):
        out = codec.tf_serving_floats(view)
        assert out.shape == view.shape and (out[view == f(2.5)] == 2.5).all()
        assert (out[view != f(2.5)] == 12345678800.0).all()  # "%.9g": TensorFlow Serving's 1.23456788e+10


def f(value: float) -> np.float32:
    return np.float32(value)


def test_vectorized_float32_decimals_equal_tensorflow_serving_s_value_by_value():
    rng = np.random.default_rng(7)
    every_kind = rng.integers(0, 2**32, size=150_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    arrays = [
        every_kind,  # random bit patterns: every exponent, subnormals, NaN and infinities
        rng.standard_normal(60_000).astype(np.float32),
        (rng.random(30_000) * 1e-5).astype(np.float32),  # small probabilities
        np.tile(
            np.array(
                [1e-4, 9.9999997e-5, 1e8, 1e9, 999999936.0, 16777216.0, 1e-14, 1e-45, 3.4e38, 1234565.0], np.float32
            ),
            10,
        ),  # fmt: skip
    ]  # each long enough for the vectorized steps
    for array in arrays:
        got = codec.tf_serving_floats(array)
        with np.errstate(invalid="ignore"):  # signalling NaNs among the bit patterns
            values = array.astype(np.float64).tolist()
        expected = np.array([codec.tf_decimal(v) if np.isfinite(v) else v for v in values])
        same = (got == expected) | (np.isnan(got) & np.isnan(expected))
        assert same.all(), [(array[i], got[i], expected[i]) for i in np.flatnonzero(~same)[:5]]


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


# -- review fixes -----------------------------------------------------------------------------------------


def test_parse_refuses_lone_surrogates_naming_where_they_are():
    # orjson refuses them; the standard library (the fallback for NaN/Infinity) would let them in
    for body, where in (
        (b'{"inputs": "\\ud800", "x": NaN}', "the string at inputs "),
        (b'{"id": "\\udfff", "inputs": [{"name": "s", "data": ["ok"]}]}', "the string at id "),
        (b'{"inputs": [{"name": "s", "data": ["ok", "a\\ud800b"]}]}', "the string at inputs[0].data[1] "),
        (b'{"examples": [{"\\ud800": 1.0}]}', "the key '\\ud800' of examples[0] "),
        (b'{"examples": [{"a b": "\\udc00"}]}', "the string at examples[0]['a b'] "),
    ):
        with pytest.raises(InvalidArgument) as e:
            codec.parse(body)
        assert where in e.value.message and "is not valid Unicode" in e.value.message, e.value.message
        assert "lone surrogate" in e.value.message
    # a surrogate pair is one character, and an escaped backslash before "ud800" no surrogate at all
    assert codec.parse(b'{"id": "\\ud83d\\ude00", "x": NaN}')["id"] == "\U0001f600"
    assert codec.parse(b'{"id": "\\\\ud800", "x": NaN}')["id"] == "\\ud800"


def test_parse_refuses_numbers_beyond_a_double():
    with pytest.raises(InvalidArgument, match="the number 1e400 is beyond the range of a 64-bit float"):
        codec.parse(b'{"instances": [1e400]}')
    with pytest.raises(InvalidArgument, match=r"-1E\+999 is beyond"):
        codec.parse(b'{"instances": [NaN, -1E+999]}')
    assert codec.parse(b'{"instances": [1e300, -Infinity, 1e-400]}')["instances"] == [1e300, float("-inf"), 0.0]


@pytest.mark.parametrize(
    ("value", "dtype", "words"),
    [
        ([1.0, 100000], np.float16, "inputs[1] = 100000 to float16 without loss of precision"),
        ([2049], np.float16, "inputs[0] = 2049 to float16 without loss of precision"),
        ([100000.0], np.float16, "inputs[0] = 100000.0 to float16 without loss of precision (out of its range)"),
        ([16777217], ml_dtypes.bfloat16, "inputs[0] = 16777217 to bfloat16 without loss of precision"),
        ([257], ml_dtypes.bfloat16, "inputs[0] = 257 to bfloat16 without loss of precision"),
        ([1.0, 1e39], ml_dtypes.bfloat16, "inputs[1] = 1e+39 to bfloat16 without loss of precision (out of its range)"),
        ([-1, 2**64 - 1], np.float32, "inputs[1] = 18446744073709551615 to float32 without loss of precision"),
        ([1.5, 16777217], np.float32, "inputs[1] = 16777217 to float32 without loss of precision"),
        ([[0.5, -(2**70)]], np.float64, "inputs[0][1] = -1180591620717411303424 to float64 without loss"),
    ],
)
def test_every_float_dtype_refuses_what_it_cannot_hold(value, dtype, words):
    assert words in refused(value, dtype)


def test_half_precision_floats_take_what_they_hold():
    assert to_array([2047, -2047, 0.1, 65504.0], np.float16).tolist() == [2047, -2047, np.float16(0.1), 65504]
    assert to_array([255, 1.5, 3e38], ml_dtypes.bfloat16).astype(np.float32).tolist() == [
        255,
        1.5,
        float(np.float32(ml_dtypes.bfloat16(3e38))),
    ]
    assert to_array([1.5, 16777215], np.float32).tolist() == [1.5, 16777215.0]
    assert np.isinf(to_array([float("inf")], np.float16)).all()  # Infinity as the client wrote it


def test_lists_nested_deeper_than_a_tensor_can_be():
    deep = 1.0
    for _ in range(100):
        deep = [deep]
    message = refused(deep)
    assert "inputs is nested 100 levels deep; a tensor has at most 64 dimensions" in message
    assert "integer" not in message
    ok = 1
    for _ in range(64):
        ok = [ok]
    assert to_array(ok).ndim == 64


def test_payload_bytes_counts_strings_not_pointers():
    from servex.server.transport.http import OFFLOAD_BYTES, payload_bytes

    assert payload_bytes([np.zeros(10, np.float32), np.zeros(3, np.int64)]) == 64
    strings = np.empty(100, object)
    strings[:] = [b"x" * 1000] * 100
    assert payload_bytes([strings]) == 100_000  # not 800, the pointers' bytes
    many = np.empty(100_000, object)
    many[:] = [b"ab"] * 100_000
    assert payload_bytes([many]) >= OFFLOAD_BYTES  # many strings: large, without summing them
    assert payload_bytes([b"abc"]) == 3  # a 0-d string fetched as bytes


@pytest.mark.parametrize(
    ("accept", "coding"),
    [
        ("gzip", "gzip"),
        ("gzip, deflate", "deflate"),
        ("gzip;q=0", None),
        ("gzip; q=0.0, identity", None),
        ("deflate;q=0, gzip", "gzip"),
        ("gzip;q=1, deflate;q=0.5", "gzip"),
        ("x-gzip", "gzip"),
        ("GZIP;Q=0.3", "gzip"),
        ("br, identity", None),
        ("", None),
        ("gzip;q=abc", None),
    ],
)
def test_answer_coding_honours_q_values(accept, coding):
    from aiohttp.test_utils import make_mocked_request

    from servex.server.transport.compression import answer_coding

    found = answer_coding(make_mocked_request("POST", "/", headers={"Accept-Encoding": accept}))
    assert (found.value if found else None) == coding


def test_too_large_says_more_than_the_limit():
    from servex.server.transport.http import too_large

    error = too_large("the request body has 5019 bytes, more than", 4096)
    assert error.message == "the request body has 5019 bytes, more than the limit of 4096 bytes (--max_message_bytes)"
    assert status_of(error) == 413
