"""Requests to the daemon with the real client libraries: TensorFlow Serving's stubs (tensorflow-serving-api),
servex's own services, and tritonclient for the KServe v2 protocol."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    inference_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
    session_service_pb2,
)

from servex.protos.servex.v1 import graph_executor_pb2, graph_executor_pb2_grpc, variables_pb2_grpc

CLASSIFY = "tensorflow/serving/classify"
REGRESS = "tensorflow/serving/regress"
PREDICT = "tensorflow/serving/predict"
SESSION_RUN = "/tensorflow.serving.SessionService/SessionRun"
PRIORITY = "x-servex-priority"  # the gRPC metadata key of a request's priority


# -- TensorFlow Serving's PredictionService ---------------------------------------------------------------------


def tensor(value) -> tensor_pb2.TensorProto:
    """``value`` as a TensorProto (as it is when it already is one; Python floats become float32)."""
    return value if isinstance(value, tensor_pb2.TensorProto) else tf.make_tensor_proto(value)


def predict_request(
    model: str, inputs=None, *, signature: str = "", version: int | None = None, label: str = "", output_filter=()
) -> predict_pb2.PredictRequest:
    """A PredictRequest of ``model``: ``inputs`` maps aliases to values (TensorProtos or what
    ``tf.make_tensor_proto`` takes); a value that is no dict is the input ``x``."""
    req = predict_pb2.PredictRequest()
    req.model_spec.name = model
    req.model_spec.signature_name = signature
    if version is not None:
        req.model_spec.version.value = version
    if label:
        req.model_spec.version_label = label
    if inputs is not None:
        for alias, value in (inputs if isinstance(inputs, dict) else {"x": inputs}).items():
            req.inputs[alias].CopyFrom(tensor(value))
    req.output_filter.extend(output_filter)
    return req


def predict(
    channel, model: str, inputs=None, *, timeout: float = 30, priority: int | None = None, metadata=None, **spec
) -> predict_pb2.PredictResponse:
    """Predict on ``channel`` (``predict_request``'s arguments); ``priority`` goes in servex's priority metadata."""
    if priority is not None:
        metadata = (*(metadata or ()), (PRIORITY, str(priority)))
    req = predict_request(model, inputs, **spec)
    return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(req, timeout=timeout, metadata=metadata)


def outputs(reply) -> dict[str, np.ndarray]:
    """A PredictResponse's outputs, by alias, as NumPy arrays."""
    return {alias: tf.make_ndarray(t) for alias, t in reply.outputs.items()}


def predict_outputs(channel, model: str, inputs=None, **kwargs) -> dict[str, np.ndarray]:
    """Every output of a Predict call (``predict``'s arguments), by alias, as NumPy arrays."""
    return outputs(predict(channel, model, inputs, **kwargs))


def predict_first(channel, model: str, inputs=None, **kwargs) -> np.ndarray:
    """The (first) output of a Predict call (``predict``'s arguments), as a NumPy array."""
    return next(iter(predict_outputs(channel, model, inputs, **kwargs).values()))


def y(reply) -> list[float]:
    """half_plus_two's output ``y``, flattened."""
    return tf.make_ndarray(reply.outputs["y"]).ravel().tolist()


def predict_y(channel, model: str, x, **kwargs) -> list[float]:
    """half_plus_two's answer ``y`` (flattened) to input ``x`` sent as float32 (``predict``'s keyword arguments)."""
    return y(predict(channel, model, np.asarray(x, np.float32), **kwargs))


def call(channel, request, timeout: float = 30):
    """Send a Predict, Classify, Regress or MultiInference request by the PredictionService method of its type."""
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    methods = {"PredictRequest": stub.Predict, "ClassificationRequest": stub.Classify,
               "RegressionRequest": stub.Regress, "MultiInferenceRequest": stub.MultiInference}  # fmt: skip
    return methods[type(request).__name__](request, timeout=timeout)


# -- Classify, Regress and MultiInference (tf.Example inputs) ----------------------------------------------------


def example(**features) -> tf.train.Example:
    return tf.train.Example(
        features=tf.train.Features(
            feature={k: tf.train.Feature(float_list=tf.train.FloatList(value=[v])) for k, v in features.items()}
        )
    )


def set_spec(model_spec, model, signature, version=None):
    model_spec.name = model
    model_spec.signature_name = signature
    if version is not None:
        model_spec.version.value = version


def classify_request(model="tf1", signature="classify_x_to_y", xs=(2.0,), version=None):
    request = classification_pb2.ClassificationRequest()
    set_spec(request.model_spec, model, signature, version)
    request.input.example_list.examples.extend(example(x=x) for x in xs)
    return request


def regress_request(model="tf1", signature="regress_x_to_y2", xs=(2.0,)):
    request = regression_pb2.RegressionRequest()
    set_spec(request.model_spec, model, signature)
    request.input.example_list.examples.extend(example(x=x) for x in xs)
    return request


def multi_request(tasks, model="tf1", xs=(2.0,)):
    request = inference_pb2.MultiInferenceRequest()
    for signature, method in tasks:
        task = request.tasks.add(method_name=method)
        set_spec(task.model_spec, model, signature)
    request.input.example_list.examples.extend(example(x=x) for x in xs)
    return request


# -- runs by tensor name: SessionService/SessionRun and servex.v1.GraphExecutor/Run -----------------------------


def session_run(channel, model, feeds=None, fetches=(), targets=(), *, alias=False, signature=""):
    req = session_service_pb2.SessionRunRequest(fetch=list(fetches), target=list(targets), tensor_name_is_alias=alias)
    req.model_spec.name = model
    req.model_spec.signature_name = signature
    for name, value in (feeds or {}).items():
        named = req.feed.add(name=name)
        named.tensor.CopyFrom(tf.make_tensor_proto(value))
    call = channel.unary_unary(
        SESSION_RUN,
        request_serializer=session_service_pb2.SessionRunRequest.SerializeToString,
        response_deserializer=session_service_pb2.SessionRunResponse.FromString,
    )
    reply = call(req, timeout=30)
    return {t.name: tf.make_ndarray(t.tensor) for t in reply.tensor}, reply


def run(channel, model, feeds, fetches, targets=(), graph_name=""):
    req = graph_executor_pb2.RunRequest(graph_name=graph_name, fetches=list(fetches), targets=list(targets))
    req.model.name = model
    for name, value in feeds.items():
        req.feeds[name].CopyFrom(tf.make_tensor_proto(value))
    reply = graph_executor_pb2_grpc.GraphExecutorStub(channel).Run(req, timeout=30)
    return [tf.make_ndarray(t) for t in reply.outputs], reply


def expect_error(code, fragments, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` fails with gRPC status ``code`` and details holding every one of ``fragments``."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details(), info.value.details()


# -- servex's admin port ---------------------------------------------------------------------------------------


def admin_stub(port):
    return variables_pb2_grpc.VariableServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


# -- KServe v2 through tritonclient ----------------------------------------------------------------------------


def infer_input(name, array, datatype=None):
    import tritonclient.grpc as triton

    datatype = datatype or triton.np_to_triton_dtype(array.dtype)
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)  # BF16 as ml_dtypes.bfloat16, as tritonclient takes it since r26.06
    return tensor


def expect_inference_error(call, protocol: str, status: str, http_status: int, words: str) -> None:
    """``call()`` raises tritonclient's InferenceServerException with this gRPC ``status`` (``protocol`` "grpc") or
    ``http_status`` (else), its message holding ``words``."""
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        call()
    if protocol == "grpc":
        assert info.value.status() == f"StatusCode.{status}", info.value
    else:
        assert info.value.status() == str(http_status), info.value
    assert words in info.value.message(), info.value.message()
