"""TensorFlow Serving's REST request/answer formats and KServe v2 REST tensors, without a server: row and
columnar predict bodies, ``_bytes`` outputs in base64, tf.Example JSON, v2 binary inputs as views over the body
(no copy) and binary outputs after the JSON."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import regression_pb2

from servex.loader.errors import FailedPrecondition, InvalidArgument
from servex.loader.saved_model import TensorSpec
from servex.server.core import RequestInfo
from servex.server.protocols.kserve import dataplane_rules as rules
from servex.server.protocols.kserve import rest_api as rest_v2
from servex.server.protocols.kserve import rest_tensors, v2_types
from servex.server.protocols.kserve.shared_memory import SharedMemoryRegistry
from servex.server.protocols.tfserving.rest_api import decode_predict, encode_predict, fill_input

X = TensorSpec("x:0", types_pb2.DT_FLOAT, np.dtype(np.float32), (None, 2))
S = TensorSpec("s:0", types_pb2.DT_STRING, np.dtype(object), (None,))
K = TensorSpec("k:0", types_pb2.DT_INT64, np.dtype(np.int64), (None,))


def refused(doc, specs) -> str:
    with pytest.raises(InvalidArgument) as e:
        decode_predict(doc, specs)
    return e.value.message


# -- TensorFlow Serving -----------------------------------------------------------------------------------


def test_row_format_one_input_and_named_inputs():
    inputs, row = decode_predict({"instances": [[1, 2], [3, 4]]}, {"x": X})
    assert row and inputs["x"].tolist() == [[1.0, 2.0], [3.0, 4.0]] and inputs["x"].dtype == np.float32
    inputs, row = decode_predict(
        {"instances": [{"s": "a", "k": 1}, {"s": {"b64": base64.b64encode(b"\xff").decode()}, "k": 2}]},
        {"s": S, "k": K},
    )
    assert inputs["s"].tolist() == [b"a", b"\xff"] and inputs["k"].tolist() == [1, 2]


def test_b64_as_tensorflow_serving_decodes_it_wrapped_in_lines_and_with_dot_padding():
    """absl::Base64Unescape, which TensorFlow Serving decodes with, skips whitespace and takes '.' as padding:
    base64 wrapped in lines (Python's base64.encodebytes, the base64 tool) serves."""
    raw = bytes(range(256)) * 2
    wrapped = base64.encodebytes(raw).decode()
    assert "\n" in wrapped
    for text, expected in [
        (wrapped, raw),
        (" aGVs\r\n bG8=\n", b"hello"),
        ("aGVsbG8.", b"hello"),
        ("aGVsbA..", b"hell"),
        ("aGVsbA", b"hell"),
    ]:
        inputs, _ = decode_predict({"instances": [{"b64": text}]}, {"s": S})
        assert inputs["s"].tolist() == [expected], text
    for bad in ("aGVs*bG8=", "aGVsbA===", "a", "aGVs-_"):  # other characters, too much padding, web-safe alphabet
        message = refused({"instances": [{"b64": bad}]}, {"s": S})
        assert "not valid base64" in message and "whitespace is skipped" in message, bad


def test_columnar_format():
    inputs, row = decode_predict({"inputs": {"s": [["a", "b"]], "k": 5, "ignored": 1}}, {"s": S, "k": K})
    assert not row and inputs["s"].shape == (1, 2) and inputs["k"].shape == ()
    inputs, _ = decode_predict({"inputs": [[1, 2]]}, {"x": X})
    assert inputs["x"].shape == (1, 2)


def test_predict_body_errors():
    two = {"s": S, "k": K}
    assert "plain list, but the signature has 2 inputs" in refused({"instances": ["a"]}, two)
    assert "missing ['k']" in refused({"instances": [{"s": "a"}]}, two)
    assert "instances[1] is a array" in refused({"instances": [{"s": "a", "k": 1}, ["b"]]}, two)
    assert "Missing named input(s) ['k']" in refused({"inputs": {"s": ["a"]}}, two)
    assert "plain value/list" in refused({"inputs": ["a"]}, two)
    assert "'instances' must be a list" in refused({"instances": {"x": 1}}, {"x": X})
    assert "ragged" in refused({"instances": [["a", "b"], ["c"]]}, {"s": S})
    assert "expected a string or" in refused({"instances": [1]}, {"s": S})
    assert "not valid base64" in refused({"instances": [{"b64": "***"}]}, {"s": S})


def test_answers_row_and_columnar():
    y = np.array([[1.5], [2.0]], np.float32)
    assert json.loads(encode_predict({"y": y}, True)) == {"predictions": [[1.5], [2.0]]}
    assert json.loads(encode_predict({"y": y}, False)) == {"outputs": [[1.5], [2.0]]}
    both = {"y": y, "tag_bytes": np.array([b"\x00\x01", b"z"], object), "name": np.array([b"a", b"b"], object)}
    assert json.loads(encode_predict(both, True)) == {
        "predictions": [
            {"y": [1.5], "tag_bytes": {"b64": "AAE="}, "name": "a"},
            {"y": [2.0], "tag_bytes": {"b64": "eg=="}, "name": "b"},
        ]
    }
    assert json.loads(encode_predict(both, False))["outputs"]["tag_bytes"] == [{"b64": "AAE="}, {"b64": "eg=="}]


def test_row_answer_needs_one_batch_size():
    with pytest.raises(InvalidArgument, match="batch size 3, expecting 2"):
        encode_predict({"a": np.zeros(2), "b": np.zeros(3)}, True)
    with pytest.raises(InvalidArgument, match="is a scalar"):
        encode_predict({"a": np.float32(1.0) * np.ones(())}, True)
    assert json.loads(encode_predict({"a": np.zeros(2), "b": np.zeros(3)}, False)) == {
        "outputs": {"a": [0.0, 0.0], "b": [0.0, 0.0, 0.0]}
    }


def test_examples_json_as_tensorflow_serving_builds_them():
    request = regression_pb2.RegressionRequest()
    doc = {
        "context": {"c": "ctx"},
        "examples": [{"f": 1.5, "i": [1, 2], "b": True, "s": "t", "raw": {"b64": "AAE="}, "e": []}],
    }
    fill_input(doc, request.input)
    context = request.input.example_list_with_context.context.features.feature
    assert context["c"].bytes_list.value == [b"ctx"]
    feature = request.input.example_list_with_context.examples[0].features.feature
    assert feature["f"].float_list.value == [1.5]
    assert feature["i"].int64_list.value == [1, 2] and feature["b"].int64_list.value == [1]
    assert feature["s"].bytes_list.value == [b"t"] and feature["raw"].bytes_list.value == [b"\x00\x01"]
    assert feature["e"].WhichOneof("kind") is None
    for doc, words in (
        ({"examples": [{"f": [1.5, "a"]}]}, 'bytes ("a") in a feature of type float'),
        ({"examples": [{"f": None}]}, "unexpected JSON type null"),
        ({"examples": [{"f": [[1]]}]}, "unexpected JSON type array"),
        ({"examples": [{"f": 2**64}]}, "does not fit int64"),
        ({"examples": []}, "empty array"),
        ({"examples": [3]}, "examples[0] must be a JSON object"),
    ):
        with pytest.raises(InvalidArgument) as e:
            fill_input(doc, regression_pb2.RegressionRequest().input)
        assert words in e.value.message


# -- KServe v2 --------------------------------------------------------------------------------------------


def test_binary_inputs_are_views_over_the_body():
    raw = np.arange(6, dtype=np.float32).tobytes() + struct.pack("<I", 2) + b"hi"
    body = memoryview(bytes(raw))
    doc = {
        "inputs": [
            {"name": "a", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": 24}},
            {"name": "s", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}},
            {"name": "j", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]},
        ]
    }
    arrays = rest_v2.decode_inputs(doc, body, SharedMemoryRegistry())
    assert arrays["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert np.shares_memory(arrays["a"], np.frombuffer(body, np.uint8))  # no copy of the body
    assert arrays["s"].tolist() == [b"hi"] and arrays["j"].dtype == np.int64


def test_parameters_priority_timeout_and_outputs():
    info = RequestInfo()
    doc = {
        "id": "r",
        "parameters": {"priority": 9, "timeout": 5_000_000, "binary_data_output": True},
        "outputs": [
            {"name": "a"},
            {"name": "b", "parameters": {"binary_data": False, "classification": 3}},
            {"name": "c", "parameters": {"binary_data": True}},
        ],
    }
    request = rest_v2.infer_request("m", "", doc, info)
    # Triton's rule: binary_data_output covers the outputs the request does not name; a named one is JSON unless it
    # asks for binary itself.
    binary, filters = request.binary_output, request.binary()
    assert (request.id, request.signature, binary, filters) == ("r", "", True, {"a": False, "b": False, "c": True})
    assert request.classes() == {"b": 3} and request.places() == {}
    assert info.priority == 9 and info.deadline is not None
    # the data plane's words, the same over gRPC (was "parameters.priority must be an integer" over REST)
    with pytest.raises(InvalidArgument, match="parameter 'priority' must be an integer"):
        rest_v2.infer_request("m", "", {"parameters": {"priority": True}}, RequestInfo())
    with pytest.raises(InvalidArgument, match="requested twice"):
        rest_v2.infer_request("m", "", {"outputs": [{"name": "a"}, {"name": "a"}]}, RequestInfo())
    # the data plane's words (was "needs parameters.shared_memory_byte_size" over REST)
    with pytest.raises(InvalidArgument, match="output 'a': a shared memory region needs parameter 'shared_memory_b"):
        rest_v2.infer_request("m", "", {"outputs": [{"name": "a", "parameters": {"shared_memory_region": "r"}}]})
    shared = {"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": 8}
    assert rest_v2.infer_request("m", "", {"outputs": [{"name": "a", "parameters": shared}]}).places() == {
        "a": ("r", 8, 64)
    }


def test_classified_outputs_are_the_top_classes_per_row():
    outputs = {"p": np.array([[0.25, 0.5, 0.125]], np.float32), "v": np.array([3, 9, 1], np.int64), "o": np.ones(2)}
    answer = v2_types.classified(outputs, {"p": 2, "v": 5})
    assert answer["p"].tolist() == [[b"0.500000:1", b"0.250000:0"]]
    assert answer["v"].tolist() == [b"9:1", b"3:0", b"1:2"]  # at most the classes there are
    assert answer["o"] is outputs["o"] and outputs["p"].dtype == np.float32  # the rest as they were
    with pytest.raises(InvalidArgument, match="cannot be classified: it is float64 of shape"):
        v2_types.classified({"s": np.ones((1, 2, 3))}, {"s": 1})
    with pytest.raises(InvalidArgument, match="ask for at least 1 class"):
        rules.classification_count(0, "p")


def test_outputs_json_and_binary():
    chunks: list = []
    outputs = {"y": np.array([[1.5, 2.0]], np.float32), "t": np.array([b"ab"], object), "n": np.array([np.nan])}
    entries, finite = rest_v2.encode_outputs(outputs, {"y": True, "t": False, "n": False}, False, chunks)
    assert entries[0] == {"name": "y", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}}
    assert bytes(chunks[0]) == np.array([1.5, 2.0], "<f4").tobytes()
    assert entries[1]["data"] == ["ab"] and not finite
    with pytest.raises(FailedPrecondition, match="complex64"):
        rest_v2.encode_outputs({"c": np.zeros(1, np.complex64)}, {}, False, [])
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        rest_v2.encode_outputs({"t": np.array([b"\xff"], object)}, {}, False, [])


# -- review fixes -----------------------------------------------------------------------------------------


def test_versions_of_thousands_of_digits_are_refused_not_converted():
    from aiohttp.test_utils import make_mocked_request

    from servex.server.protocols.tfserving.rest_api import PREDICT_PATH, STATUS_PATH, _spec

    digits = "1" + "0" * 5000  # int() refuses more than 4300 digits: ValueError, once a 500
    for match in (PREDICT_PATH.fullmatch(f"/v1/models/m/versions/{digits}:predict"),
                  STATUS_PATH.fullmatch(f"/v1/models/m/versions/{digits}")):  # fmt: skip
        with pytest.raises(InvalidArgument) as e:
            _spec(match)
        assert "Failed to convert version: 10000000000000000000...(5001 digits)" in e.value.message
    assert _spec(PREDICT_PATH.fullmatch("/v1/models/m/versions/9223372036854775807:predict"))[1] == 2**63 - 1
    for text in (digits, "9223372036854775808", "\u00b9"):
        request = make_mocked_request("GET", "/v2/models/m/versions/x", match_info={"version": text})
        with pytest.raises(InvalidArgument, match="is not a version number"):
            rules.parse_version(rest_v2._version(request))  # the data plane parses what REST's path holds
    assert rules.parse_version(rest_v2._version(make_mocked_request("GET", "/", match_info={"version": "0042"}))) == 42


def test_strings_nested_deeper_than_a_tensor_can_be():
    deep = "a"
    for _ in range(70):
        deep = [deep]
    message = refused({"instances": deep}, {"s": S})
    assert "instances is nested 70 levels deep; a tensor has at most 64 dimensions" in message


def test_examples_become_serialized_tensor_and_results_json():
    from tensorflow.core.example import example_pb2

    from servex.server.protocols.tfserving.rest_api import encode_results, serialized_examples

    tensor = serialized_examples({"context": {"c": 1}, "examples": [{"f": 1.5}, {"f": [2.0, 3.0]}]})
    assert tensor.dtype == object and tensor.shape == (2,)
    merged = example_pb2.Example.FromString(tensor[1]).features.feature  # the context's bytes, then the example's
    assert merged["c"].int64_list.value == [1] and merged["f"].float_list.value == [2.0, 3.0]
    regress = encode_results("regress", {"outputs": np.array([[0.2], [3.0]], np.float32)}, 2, "w")
    assert json.loads(regress) == {"results": [0.2, 3.0]}
    classify = encode_results(
        "classify",
        {"classes": np.array([[b"a", b"b"]], object), "scores": np.array([[0.25, np.inf]], np.float32)},
        1,
        "w",
    )
    assert classify == b'{"results":[[["a",0.25],["b",Infinity]]]}'
    with pytest.raises(InvalidArgument, match="output 'outputs' has batch size 1"):
        encode_results("regress", {"outputs": np.zeros(1, np.float32)}, 2, "w")


def test_inputs_read_from_shared_memory_count_toward_decoding_off_the_loop():
    # A few hundred bytes of JSON can name a region of hundreds of MiB, copied when decoded: those bytes count.
    region = {"shared_memory_region": "r", "shared_memory_byte_size": 256 << 20}
    doc = {"inputs": [{"name": "a", "parameters": region}, {"name": "b", "data": [1]}, "odd", {"parameters": 3}]}
    assert rest_tensors.shared_bytes(doc) == 256 << 20
    assert rest_tensors.shared_bytes({"inputs": [{"parameters": {"shared_memory_region": "r"}}]}) == 0
    assert rest_tensors.shared_bytes([]) == 0
