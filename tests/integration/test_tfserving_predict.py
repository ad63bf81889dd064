"""TensorFlow Serving's PredictionService and ModelService, called with tensorflow-serving-api stubs against
TensorFlow Serving's own half_plus_two test models (TF1 and TF2) served by the real daemon."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    prediction_service_pb2_grpc,
)

from tests.support.clients import predict_request
from tests.support.daemon import metric
from tests.support.paths import EXPECTED, HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2

MODEL = "default"


@dataclass(frozen=True)
class Flavor:
    """What differs between the TF1 and TF2 exports of half_plus_two: serving_default's input shape."""

    name: str
    path: Path
    x_shape: tuple[int, ...]  # a batch of three
    shape_text: str  # the signature's shape, as error messages print it
    bad_shapes: tuple[tuple[int, ...], ...]  # shapes the signature rejects (same rank, other non-batch dims)
    other_ranks: tuple[tuple[int, ...], ...]  # other ranks: left to TensorFlow, which computes them here
    x_default: list[float] | None  # serving_default's default for x (SignatureDef.defaults), if any


FLAVORS = {
    "tf1": Flavor("tf1", HALF_PLUS_TWO_TF1, (3, 1), "[-1,1]", ((2, 2), (3, 3)), ((3,),), None),
    # TF2's export declares x as [1]; dimension 0 is the batch and takes any size. Its function's argument has
    # a default (x=[0.0]), which the SignatureDef carries.
    "tf2": Flavor("tf2", HALF_PLUS_TWO_TF2, (3,), "[1]", (), ((3, 1), ()), [0.0]),
}


@pytest.fixture(scope="module", params=sorted(FLAVORS))
def flavor(request) -> Flavor:
    return FLAVORS[request.param]


@pytest.fixture(scope="module")
def daemon(flavor, start_daemon):
    return start_daemon(f"--model_base_path={flavor.path}")


@pytest.fixture
def stub(daemon):
    return prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)


def assert_half_plus_two(stub, flavor, values=(1.0, 2.0, 5.0)):
    x = np.array(values, np.float32).reshape((len(values), *flavor.x_shape[1:]))
    reply = stub.Predict(predict_request(MODEL, x), timeout=10)
    np.testing.assert_array_equal(tf.make_ndarray(reply.outputs["y"]), 0.5 * x + 2)
    return reply


def rpc_error(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10)
    return info.value


def test_predict_half_plus_two(stub, flavor):
    reply = stub.Predict(
        predict_request(MODEL, np.array([1.0, 2.0, 5.0], np.float32).reshape(flavor.x_shape)), timeout=10
    )
    y = tf.make_ndarray(reply.outputs["y"])
    np.testing.assert_array_equal(y, np.array([2.5, 3.0, 4.5], np.float32).reshape(flavor.x_shape))
    assert reply.model_spec.name == MODEL
    assert reply.model_spec.version.value == 123
    assert reply.model_spec.signature_name == "serving_default"
    # TensorFlow Serving answers in the typed field, and clients read it directly.
    assert list(reply.outputs["y"].float_val) == [2.5, 3.0, 4.5]


def test_predict_typed_values_and_scalar_broadcast(stub, flavor):
    req = predict_request(MODEL)
    typed = req.inputs["x"]
    typed.dtype = types_pb2.DT_FLOAT
    for size in flavor.x_shape:
        typed.tensor_shape.dim.add(size=size)
    typed.float_val.extend([1.0, 2.0, 5.0])
    assert list(tf.make_ndarray(stub.Predict(req, timeout=10).outputs["y"]).ravel()) == [2.5, 3.0, 4.5]
    del typed.float_val[:]
    typed.float_val.append(4.0)  # one value fills the whole shape
    assert list(tf.make_ndarray(stub.Predict(req, timeout=10).outputs["y"]).ravel()) == [4.0, 4.0, 4.0]


def test_predict_explicit_version_and_output_filter(stub, flavor):
    x = np.full((1, *flavor.x_shape[1:]), 3.0, np.float32)
    req = predict_request(MODEL, x, version=123, signature="serving_default", output_filter=["y"])
    reply = stub.Predict(req, timeout=10)
    assert list(reply.outputs) == ["y"]
    assert tf.make_ndarray(reply.outputs["y"]).ravel().tolist() == [3.5]


def test_predict_string_input_through_classify_signature(stub, daemon):
    example = tf.train.Example(
        features=tf.train.Features(
            feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[6.0])),
            }
        )
    )
    req = predict_request(MODEL, signature="classify_x_to_y")
    req.inputs["inputs"].CopyFrom(tf.make_tensor_proto([example.SerializeToString()], dtype=tf.string))
    reply = stub.Predict(req, timeout=10)
    assert tf.make_ndarray(reply.outputs["scores"]).ravel().tolist() == [5.0]


def test_same_answers_repeatedly(stub, flavor):
    for _ in range(3):
        assert_half_plus_two(stub, flavor, values=(7.0,))


def _ones(flavor, dtype=np.float32):
    return np.ones((1, *flavor.x_shape[1:]), dtype)


def _with_extra_input(flavor):
    req = predict_request(MODEL, _ones(flavor))
    req.inputs["z"].CopyFrom(tf.make_tensor_proto(_ones(flavor)))
    return req


def _bad_tensor_content(flavor):
    req = predict_request(MODEL)
    req.inputs["x"].CopyFrom(tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=b"\0" * 8))
    for size in flavor.x_shape:
        req.inputs["x"].tensor_shape.dim.add(size=size)
    return req


ERROR_CASES = {
    "unknown-model": (
        lambda f: predict_request("nope", _ones(f)),
        grpc.StatusCode.NOT_FOUND,
        ["Servable not found for request: Latest(nope); ", "'nope'", "served models: default"],
    ),
    "unknown-version": (
        lambda f: predict_request(MODEL, _ones(f), version=7),
        grpc.StatusCode.NOT_FOUND,
        ["Servable not found for request: Specific(default, 7); ", "no version 7", "123"],
    ),
    "unknown-signature": (
        lambda f: predict_request(MODEL, _ones(f), signature="nosuch"),
        grpc.StatusCode.FAILED_PRECONDITION,
        ["'nosuch'", "serving_default", "classify_x_to_y", "regress_x_to_y"],
    ),
    "unknown-input": (
        _with_extra_input,
        grpc.StatusCode.INVALID_ARGUMENT,
        ["unknown input(s) ['z']", "expected inputs: x"],
    ),
    "wrong-dtype": (
        lambda f: predict_request(MODEL, _ones(f, np.float64)),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["'x'", "DT_FLOAT", "DT_DOUBLE"],
    ),
    "bad-tensor-content": (
        _bad_tensor_content,
        grpc.StatusCode.INVALID_ARGUMENT,
        ["'x'", "tensor_content holds 8 bytes", "needs 12"],
    ),
    "unknown-output-filter": (
        lambda f: predict_request(MODEL, _ones(f), output_filter=["z"]),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["output_filter", "'z'", "outputs are: y"],
    ),
    "no-model-name": (
        lambda f: predict_request("", _ones(f)),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["model_spec.name is empty"],
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_predict_errors_name_what_was_wrong_and_server_keeps_serving(stub, flavor, case):
    make_request, code, fragments = ERROR_CASES[case]
    error = rpc_error(stub.Predict, make_request(flavor))
    assert error.code() == code, error.details()
    for fragment in fragments:
        assert fragment in error.details()
    assert_half_plus_two(stub, flavor)


def test_a_missing_input_takes_the_signature_s_default_or_is_named(stub, flavor):
    if flavor.x_default is None:  # TF1: no default, so x is required
        error = rpc_error(stub.Predict, predict_request(MODEL))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "missing input(s) ['x']" in error.details() and "x (DT_FLOAT " in error.details()
    else:  # as TensorFlow Serving: the SignatureDef's default is fed
        y = tf.make_ndarray(stub.Predict(predict_request(MODEL), timeout=30).outputs["y"])
        assert y.tolist() == [0.5 * v + 2 for v in flavor.x_default]
    assert_half_plus_two(stub, flavor)


def test_predict_shapes_refused_and_left_to_tensorflow(stub, flavor):
    for shape in flavor.bad_shapes:  # the signature's other dimensions are checked, naming both shapes
        error = rpc_error(stub.Predict, predict_request(MODEL, np.ones(shape, np.float32)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'x'" in error.details() and f"expects shape {flavor.shape_text}" in error.details()
        assert f"got {list(shape)}" in error.details()
    for shape in flavor.other_ranks:  # as TensorFlow Serving: another rank goes to TensorFlow, which takes it
        x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        y = tf.make_ndarray(stub.Predict(predict_request(MODEL, x), timeout=30).outputs["y"])
        np.testing.assert_array_equal(y, 0.5 * x + 2)
    assert_half_plus_two(stub, flavor)


def test_get_model_metadata_matches_tensorflow_serving(stub, flavor):
    req = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    req.model_spec.name = MODEL
    reply = stub.GetModelMetadata(req, timeout=10)
    assert reply.model_spec.name == MODEL and reply.model_spec.version.value == 123
    got = get_model_metadata_pb2.SignatureDefMap()
    assert reply.metadata["signature_def"].Unpack(got)
    expected = get_model_metadata_pb2.SignatureDefMap()
    if flavor.name == "tf1":  # what TensorFlow Serving answered for this model, recorded in its test data
        doc = json.loads((EXPECTED / "half_plus_two_model_metadata.json").read_text())
        json_format.ParseDict(doc["metadata"]["signature_def"], expected)
    else:  # the SavedModel's own signature map, whole, as TensorFlow Serving answers
        saved = saved_model_pb2.SavedModel.FromString((flavor.path / "00000123" / "saved_model.pb").read_bytes())
        for name, sig in saved.meta_graphs[0].signature_def.items():
            expected.signature_def[name].CopyFrom(sig)
        assert "classify_x_to_y" in expected.signature_def
        # TF2's bookkeeping signature too, as TensorFlow Serving's recorded answer for a TF2 export has it.
        doc = json.loads((EXPECTED / "saved_model_half_plus_two_tf2_2_versions_metadata.json").read_text())
        recorded = get_model_metadata_pb2.SignatureDefMap()
        json_format.ParseDict(doc["metadata"]["signature_def"], recorded)
        init_op = "__saved_model_init_op"
        assert got.signature_def[init_op] == recorded.signature_def[init_op]
        assert got.signature_def["serving_default"].defaults["x"].float_val == [0.0]
    assert got == expected


@pytest.mark.parametrize(
    "fields, fragment", [([], "metadata_field is empty"), (["graph"], "['graph'] is not supported")]
)
def test_get_model_metadata_errors(stub, fields, fragment):
    req = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=fields)
    req.model_spec.name = MODEL
    error = rpc_error(stub.GetModelMetadata, req)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in error.details()


def test_get_model_status(daemon):
    stub = model_service_pb2_grpc.ModelServiceStub(daemon.channel)
    req = get_model_status_pb2.GetModelStatusRequest()
    req.model_spec.name = MODEL
    reply = stub.GetModelStatus(req, timeout=10)
    assert [(s.version, s.state, s.status.error_code) for s in reply.model_version_status] == [
        (123, get_model_status_pb2.ModelVersionStatus.AVAILABLE, 0)
    ]
    req.model_spec.name = "nope"
    error = rpc_error(stub.GetModelStatus, req)
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in error.details()
    assert error.details().startswith("Could not find any versions of model nope; ")  # TensorFlow Serving's words
    req.model_spec.name = MODEL
    req.model_spec.version.value = 7
    error = rpc_error(stub.GetModelStatus, req)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details().startswith(f"Could not find version 7 of model {MODEL}; "), error.details()


def test_health_and_reflection(daemon):
    health = health_pb2_grpc.HealthStub(daemon.channel)
    for service in ("", MODEL):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(daemon.channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"tensorflow.serving.PredictionService", "tensorflow.serving.ModelService", "grpc.health.v1.Health"} <= names


def test_metrics_count_requests(stub, daemon, flavor):
    assert_half_plus_two(stub, flavor)
    rpc_error(stub.Predict, predict_request(MODEL, _ones(flavor, np.float64)))
    assert metric(daemon, "servex_request_latency_seconds_count", method="Predict", model="default") >= 2
    ok = {"method": "Predict", "model": "default", "version": "123", "signature": "serving_default", "priority": "0"}
    assert metric(daemon, "servex_requests_total", code="OK", **ok) >= 1
    assert metric(daemon, "servex_request_latency_seconds_count", **ok) >= 1
    assert metric(daemon, "servex_requests_total", code="INVALID_ARGUMENT", method="Predict", model="default") >= 1
