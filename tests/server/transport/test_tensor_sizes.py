"""Sizing in server/transport/tensors.py: what a decoded request costs against --max_message_bytes (a
broadcast string
counts every copy), a cheap upper bound on an answer's size, output values written in chunks, and which work goes
to the requests' worker pool instead of the event loop."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import predict_pb2

from servex.loader.errors import ResourceExhausted
from servex.server.transport import tensors
from tests.support.tensor_protos import NAME, shaped

LIMIT = 256 << 20  # the server's default --max_message_bytes


@pytest.mark.parametrize(
    ("value", "shape"),
    [(b"x" * 9, [16_000_000]), (b"y" * (1 << 20), [1500])],
    ids=["9-bytes-over-16M", "1MiB-over-1500"],
)
def test_broadcast_string_counts_every_copy_against_the_limit(value, shape):
    # One string value broadcast over a shape is copied into every element once fed to TensorFlow (32 bytes
    # each besides its bytes): a message of a few bytes must not decode to gigabytes.
    proto = shaped(types_pb2.DT_STRING, shape, string_val=[value])
    with pytest.raises(ResourceExhausted, match=rf"'{NAME}'.*decodes to \d+ bytes, more than the limit"):
        tensors.to_ndarray(proto, NAME, LIMIT)


def test_a_request_s_broadcast_inputs_are_bounded_together():
    # Each broadcast decodes to 40% of the limit: two fit, a third does not, and is refused before it is made.
    rows = int(LIMIT * 0.4) // 4
    protos = {f"in{i}": shaped(types_pb2.DT_FLOAT, [rows], float_val=[float(i)]) for i in range(3)}
    decoded = asyncio.run(tensors.decode_all(dict(list(protos.items())[:2]), LIMIT))
    assert [a[-1] for a in decoded.values()] == [0.0, 1.0] and all(a.shape == (rows,) for a in decoded.values())
    with pytest.raises(ResourceExhausted) as e:
        asyncio.run(tensors.decode_all(protos, LIMIT))
    assert e.value.message == (
        f"input 'in2': shape [{rows}] of DT_FLOAT decodes to {rows * 4} bytes from 1 value(s); with the request's "
        f"other broadcast inputs ({2 * rows * 4} bytes) that is more than the limit of {LIMIT} (--max_message_bytes)"
    )


def test_inputs_sent_in_full_are_not_counted_together():
    # Values all sent are bounded by the message: two int64 inputs of 1,000 one-byte varints each decode to 16,000
    # bytes, past a 12,000-byte limit together, and are taken (each alone is within it).
    protos = {f"ids{i}": shaped(types_pb2.DT_INT64, [1000], int64_val=[1] * 1000) for i in range(2)}
    decoded = asyncio.run(tensors.decode_all(protos, 12_000))
    assert [a.sum() for a in decoded.values()] == [1000, 1000]


def test_a_large_decode_is_checked_first_and_runs_off_the_event_loop():
    # The check (the adapters resolve the model there) runs before a large decode (many typed values, or a few
    # broadcast over many elements), which runs on the requests' pool; a small decode neither calls it nor leaves
    # the loop.
    calls, threads = [], []
    broadcast = {"x": shaped(types_pb2.DT_FLOAT, [tensors.OFF_LOOP_ELEMENTS + 1], float_val=[1.0])}
    many = {"x": shaped(types_pb2.DT_FLOAT, [tensors.OFF_LOOP_ELEMENTS], float_val=[1.0] * tensors.OFF_LOOP_ELEMENTS)}
    small = {"x": shaped(types_pb2.DT_FLOAT, [3], float_val=[1.0])}
    # many broadcasts, each under the threshold, that add up past it
    spread = {f"x{i}": shaped(types_pb2.DT_FLOAT, [tensors.OFF_LOOP_ELEMENTS // 2], float_val=[1.0]) for i in range(3)}

    def refuse():
        calls.append(threading.current_thread().name)
        raise ResourceExhausted("refused by the check")

    for large in (broadcast, many, spread):
        with pytest.raises(ResourceExhausted, match="refused by the check"):
            asyncio.run(tensors.decode_all(large, LIMIT, refuse))
    assert calls == ["MainThread"] * 3
    assert asyncio.run(tensors.decode_all(small, LIMIT, refuse))["x"].tolist() == [1.0] * 3
    assert calls == ["MainThread"] * 3
    real = tensors._to_ndarray

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    tensors._to_ndarray = spy
    try:
        for large in (broadcast, many):
            assert asyncio.run(tensors.decode_all(large, LIMIT, lambda: None))["x"][-1] == 1.0
    finally:
        tensors._to_ndarray = real
    # the broadcast is found on the loop (and dropped there before it is filled), then decoded on the pool
    assert threads[0] == "MainThread" and all(t.startswith("servex-request-work") for t in threads[1:])


def test_broadcast_string_within_the_limit_decodes():
    proto = shaped(types_pb2.DT_STRING, [1000], string_val=[b"first", b"last"])
    array = tensors.to_ndarray(proto, NAME, LIMIT)
    assert array.tolist() == [b"first"] + [b"last"] * 999
    np.testing.assert_array_equal(array, tf.make_ndarray(proto))


def test_strings_sent_in_full_are_bounded_by_the_message_not_counted_again():
    # Every element sent: the message (itself under the limit) bounds them; only broadcast copies are counted.
    proto = shaped(types_pb2.DT_STRING, [1000], string_val=[b"x"] * 1000)
    assert tensors.to_ndarray(proto, NAME, 8 * 1000).tolist() == [b"x"] * 1000


@pytest.mark.parametrize(
    "array",
    [
        np.full((3, 5), -1, np.int8),  # negative ints are 10-byte varints in int_val
        np.full(7, -(2**63), np.int64),
        np.linspace(0, 1, 11, dtype=np.float32).reshape(1, 11),
        np.array([True, False]),
        np.zeros((2, 0), np.float64),
        np.array([b"", b"abc" * 100], dtype=object),
        np.array(5.0, np.float16),
        np.ones(3, np.complex128),
    ],
    ids=lambda a: f"{a.dtype}{list(a.shape)}",
)
@pytest.mark.parametrize("tensor_content", [False, True])
def test_answer_bound_is_at_least_what_the_answer_takes(array, tensor_content):
    response = predict_pb2.PredictResponse()
    tensors.fill_proto(response.outputs["a_long_output_alias"], array, tensor_content)
    assert response.ByteSize() <= tensors.answer_bound([array])


def test_answer_bound_is_unknown_for_many_strings():
    assert tensors.answer_bound([np.array([b"a"] * (tensors.STRING_SAMPLE + 1), dtype=object)]) is None


def test_large_typed_output_is_written_in_chunks(monkeypatch):
    monkeypatch.setattr(tensors, "OUTPUT_CHUNK", 7)  # chunks of 7 over 100 elements: a short last chunk
    values = np.arange(100, dtype=np.float32).reshape(4, 25) / 3
    proto = tensors.from_ndarray(values)
    assert len(proto.float_val) == 100
    np.testing.assert_array_equal(tf.make_ndarray(proto), values)


def test_typed_and_output_elements_count_what_encoding_walks():
    assert tensors.typed_elements(tf.make_tensor_proto(np.zeros((3, 4), np.float32))) == 0  # tensor_content
    assert tensors.typed_elements(shaped(types_pb2.DT_FLOAT, [3, 4], float_val=[1.0, 2.0])) == 2  # values sent
    assert tensors.typed_elements(shaped(types_pb2.DT_STRING, [], string_val=[b"a"])) == 1
    # The shape is not multiplied out: 50,000 dimensions of 2^62 (unchecked yet) would take seconds.
    assert tensors.typed_elements(shaped(types_pb2.DT_FLOAT, [2**62] * 50_000, float_val=[1.0])) == 1
    arrays = [np.zeros((2, 5), np.float32), np.array([b"a", b"b"], dtype=object)]
    assert tensors.output_elements(arrays) == 12
    assert tensors.output_elements(arrays, tensor_content=True) == 2  # numbers go as bytes; strings never do


@pytest.mark.parametrize(
    ("elements", "off"), [(tensors.OFF_LOOP_ELEMENTS - 1, False), (tensors.OFF_LOOP_ELEMENTS, True)]
)
def test_large_work_runs_off_the_event_loop(elements, off):
    async def main():
        return await tensors.off_loop(elements, lambda: threading.current_thread().name)

    # On the requests' own pool, not the default executor that model polling and reloads use.
    assert asyncio.run(main()).startswith("servex-request-work") is off
