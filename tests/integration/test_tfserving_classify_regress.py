"""TensorFlow Serving's Classify, Regress and MultiInference, called with tensorflow-serving-api stubs against
TensorFlow Serving's own test models served by the real daemon: half_plus_two (TF1, whose signatures carry the
classify/regress method names, and TF2, whose signatures all say predict and serve anyway, as TensorFlow Serving
serves them with its default --enable_signature_method_name_check=false) and half_plus_three."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (
    classification_pb2,
    inference_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from tests.support.clients import (
    CLASSIFY,
    PREDICT,
    REGRESS,
    classify_request,
    example,
    multi_request,
    regress_request,
    set_spec,
)
from tests.support.daemon import metric, model_config_file
from tests.support.paths import HALF_PLUS_THREE, HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2

FLAVORS = ("tf1", "tf2")


@pytest.fixture(scope="module")
def daemon(start_daemon, tmp_path_factory):
    models = {"tf1": HALF_PLUS_TWO_TF1, "tf2": HALF_PLUS_TWO_TF2, "three": HALF_PLUS_THREE}
    config = model_config_file(tmp_path_factory.mktemp("config"), models)
    return start_daemon(f"--model_config_file={config}")


@pytest.fixture
def stub(daemon):
    return prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)


def scores(result: classification_pb2.ClassificationResult) -> list[list[float]]:
    return [[c.score for c in row.classes] for row in result.classifications]


def values(result: regression_pb2.RegressionResult) -> list[float]:
    return [r.value for r in result.regressions]


def rpc_error(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value


def assert_still_serving(stub):
    assert scores(stub.Classify(classify_request(xs=(4.0,)), timeout=10).result) == [[4.0]]
    predict = predict_pb2.PredictRequest()
    predict.model_spec.name = "tf1"
    predict.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[2.0]], np.float32)))
    assert tf.make_ndarray(stub.Predict(predict, timeout=10).outputs["y"]).tolist() == [[3.0]]


# -- answers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", FLAVORS)
def test_classify_scores_half_plus_two(stub, model):
    reply = stub.Classify(classify_request(model, xs=(2.0,)), timeout=10)
    assert scores(reply.result) == [[3.0]]  # 0.5 * 2 + 2
    assert reply.result.classifications[0].classes[0].label == ""  # scores only: no labels
    assert (reply.model_spec.name, reply.model_spec.version.value) == (model, 123)
    assert reply.model_spec.signature_name == "classify_x_to_y"
    reply = stub.Classify(classify_request(model, xs=(1.0, 2.0, 5.0), version=123), timeout=10)
    assert scores(reply.result) == [[2.5], [3.0], [4.5]]


@pytest.mark.parametrize("model", FLAVORS)
def test_regress_x_to_y2(stub, model):
    reply = stub.Regress(regress_request(model, xs=(2.0, 4.0)), timeout=10)
    assert values(reply.result) == [4.0, 5.0]  # 0.5 * x + 3
    assert (reply.model_spec.name, reply.model_spec.version.value) == (model, 123)
    assert reply.model_spec.signature_name == "regress_x_to_y2"
    reply = stub.Regress(regress_request(model, "regress_x_to_y", xs=(2.0,)), timeout=10)
    assert values(reply.result) == [3.0]


@pytest.mark.parametrize("model", FLAVORS)
def test_example_list_with_context_merges_each_example_over_the_context(stub, model):
    request = regression_pb2.RegressionRequest()
    set_spec(request.model_spec, model, "regress_x_to_y2")
    with_context = request.input.example_list_with_context
    with_context.context.CopyFrom(example(x=10.0))
    with_context.examples.extend([example(x=2.0), example(z=1.0)])  # the first overrides x, the second keeps it
    assert values(stub.Regress(request, timeout=10).result) == [4.0, 8.0]
    classify = classification_pb2.ClassificationRequest()
    set_spec(classify.model_spec, model, "classify_x_to_y")
    classify.input.example_list_with_context.CopyFrom(with_context)
    assert scores(stub.Classify(classify, timeout=10).result) == [[3.0], [7.0]]


def test_regress_on_half_plus_three(stub):
    # Its regress signature declares the serialized-example input DT_FLOAT; TensorFlow Serving serves it anyway.
    reply = stub.Regress(regress_request("three", "tensorflow/serving/regress", xs=(1.0, 2.0)), timeout=10)
    assert values(reply.result) == [3.5, 4.0]


@pytest.mark.parametrize("model", FLAVORS)
def test_multi_inference_classify_and_regress(stub, model):
    tasks = [("classify_x_to_y", CLASSIFY), ("regress_x_to_y", REGRESS), ("regress_x_to_y2", REGRESS)]
    reply = stub.MultiInference(multi_request(tasks, model, xs=(2.0, 6.0)), timeout=10)
    assert [(r.model_spec.name, r.model_spec.version.value, r.model_spec.signature_name) for r in reply.results] == [
        (model, 123, "classify_x_to_y"),
        (model, 123, "regress_x_to_y"),
        (model, 123, "regress_x_to_y2"),
    ]
    assert scores(reply.results[0].classification_result) == [[3.0], [5.0]]
    assert values(reply.results[1].regression_result) == [3.0, 5.0]
    assert values(reply.results[2].regression_result) == [4.0, 6.0]
    assert reply.results[1].WhichOneof("result") == "regression_result"


def test_multi_inference_single_task_in_the_order_given(stub):
    reply = stub.MultiInference(multi_request([("regress_x_to_y2", REGRESS)]), timeout=10)
    assert len(reply.results) == 1 and values(reply.results[0].regression_result) == [4.0]


def test_many_examples_are_answered_through_the_worker_thread_path(stub):
    # More than examples.LARGE: serialized and answered on a worker thread, the results still in order.
    xs = np.arange(5000, dtype=np.float32)
    reply = stub.Regress(regress_request(xs=xs.tolist()), timeout=60)
    np.testing.assert_array_equal(values(reply.result), 0.5 * xs + 3)
    reply = stub.Classify(classify_request(xs=xs.tolist()), timeout=60)
    np.testing.assert_array_equal(scores(reply.result), (0.5 * xs + 2)[:, None])


# -- errors -------------------------------------------------------------------------------------------------


def _empty_input():
    request = classify_request()
    request.ClearField("input")
    return request


def _empty_example_list():
    request = classify_request()
    del request.input.example_list.examples[:]
    return request


def _missing_feature():
    request = regress_request()
    del request.input.example_list.examples[:]
    request.input.example_list.examples.append(example(z=1.0))
    return request


def _models_differ():
    request = multi_request([("classify_x_to_y", CLASSIFY), ("regress_x_to_y", REGRESS)])
    request.tasks[1].model_spec.name = "tf2"
    return request


def _versions_differ(first=None, second=124, label=""):
    request = multi_request([("classify_x_to_y", CLASSIFY), ("regress_x_to_y", REGRESS)])
    if first is not None:
        request.tasks[0].model_spec.version.value = first
    if label:
        request.tasks[1].model_spec.version_label = label
    else:
        request.tasks[1].model_spec.version.value = second
    return request


ERROR_CASES = {
    "classify-empty-input": (
        "Classify",
        _empty_input,
        grpc.StatusCode.INVALID_ARGUMENT,
        ["ClassificationRequest.input is empty", "example_list"],
    ),
    "classify-no-examples": (
        "Classify",
        _empty_example_list,
        grpc.StatusCode.INVALID_ARGUMENT,
        ["ClassificationRequest.input is empty", "holds no tf.Example"],
    ),
    "regress-empty-input": (
        "Regress",
        lambda: regress_request(xs=()),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["RegressionRequest.input is empty"],
    ),
    "classify-unknown-signature": (
        "Classify",
        lambda: classify_request(signature="nosuch"),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["no signature 'nosuch'", "available signatures: classify_x_to_y", "regress_x_to_y2"],
    ),
    "classify-unknown-model": (
        "Classify",
        lambda: classify_request(model="nope"),
        grpc.StatusCode.NOT_FOUND,
        ["Servable not found for request: Latest(nope); ", "'nope'", "served models:", "tf2"],
    ),
    "classify-on-regress-signature": (
        "Classify",
        lambda: classify_request(signature="regress_x_to_y"),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["'tf1' version 123 signature 'regress_x_to_y'", "Classify needs", "'classes'", "outputs (DT_FLOAT [-1,1])"],
    ),
    "regress-on-classify-signature": (
        "Regress",
        lambda: regress_request(signature="classify_x_to_y"),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["signature 'classify_x_to_y'", "Regress needs", "'outputs'", "outputs are: scores"],
    ),
    "regress-on-default-predict-signature": (
        "Regress",
        lambda: regress_request(signature=""),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["signature 'serving_default'", "exactly one input, 'inputs'", "inputs are: x (DT_FLOAT [-1,1])"],
    ),
    "regress-on-float-input-signature": (
        "Regress",
        lambda: regress_request(signature="regress_x2_to_y3"),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["signature 'regress_x2_to_y3'", "'x2:0'", "as DT_STRING", "declares DT_FLOAT [-1,1]"],
    ),
    "regress-missing-feature": (
        "Regress",
        _missing_feature,
        grpc.StatusCode.INVALID_ARGUMENT,
        ["signature 'regress_x_to_y2'", "Feature: x", "is required"],
    ),
    "multi-models-differ": (
        "MultiInference",
        _models_differ,
        grpc.StatusCode.INVALID_ARGUMENT,
        ["must name the same model", "tasks[0] names 'tf1', tasks[1] names 'tf2'"],
    ),
    "multi-versions-differ": (
        "MultiInference",
        lambda: _versions_differ(first=123, second=124),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["run one version of the model", "tasks[0] names version 123, tasks[1] names version 124"],
    ),
    "multi-latest-and-label": (
        "MultiInference",
        lambda: _versions_differ(label="stable"),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["tasks[0] names the latest version, tasks[1] names version_label 'stable'"],
    ),
    "multi-duplicate-signature": (
        "MultiInference",
        lambda: multi_request([("regress_x_to_y", REGRESS), ("regress_x_to_y", REGRESS)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["tasks[1] evaluates signature 'regress_x_to_y' again"],
    ),
    "multi-predict-method": (
        "MultiInference",
        lambda: multi_request([("classify_x_to_y", CLASSIFY), ("serving_default", PREDICT)]),
        grpc.StatusCode.UNIMPLEMENTED,
        ["tasks[1].method_name 'tensorflow/serving/predict' is not supported", CLASSIFY, REGRESS],
    ),
    "multi-unknown-signature": (
        "MultiInference",
        lambda: multi_request([("classify_x_to_y", CLASSIFY), ("nosuch", REGRESS)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["tasks[1]", "no signature 'nosuch'"],
    ),
    "multi-wrong-method-for-signature": (
        "MultiInference",
        lambda: multi_request([("regress_x_to_y", CLASSIFY)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["signature 'regress_x_to_y'", "Classify needs"],
    ),
    "multi-no-tasks": (
        "MultiInference",
        inference_pb2.MultiInferenceRequest,
        grpc.StatusCode.INVALID_ARGUMENT,
        ["MultiInferenceRequest.tasks is empty"],
    ),
    "multi-empty-input": (
        "MultiInference",
        lambda: multi_request([("regress_x_to_y", REGRESS)], xs=()),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["MultiInferenceRequest.input is empty"],
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_errors_name_what_was_wrong_and_server_keeps_serving(stub, case):
    method, make_request, code, fragments = ERROR_CASES[case]
    error = rpc_error(getattr(stub, method), make_request())
    assert error.code() == code, error.details()
    for fragment in fragments:
        assert fragment in error.details(), error.details()
    assert_still_serving(stub)


def test_metrics_count_classify_regress_and_multi_inference(stub, daemon):
    stub.Classify(classify_request(), timeout=10)
    stub.Regress(regress_request(), timeout=10)
    stub.MultiInference(multi_request([("regress_x_to_y", REGRESS)]), timeout=10)
    rpc_error(stub.Classify, classify_request(signature="nosuch"))
    assert metric(daemon, "servex_requests_total", code="OK", method="Classify", model="tf1") >= 1
    assert metric(daemon, "servex_requests_total", code="INVALID_ARGUMENT", method="Classify", model="tf1") >= 1
    assert metric(daemon, "servex_requests_total", code="OK", method="Regress", model="tf1") >= 1
    # MultiInferenceRequest has no top-level model_spec: its tasks' model names the request
    assert metric(daemon, "servex_requests_total", code="OK", method="MultiInference", model="tf1") >= 1
