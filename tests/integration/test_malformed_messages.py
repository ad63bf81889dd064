"""Bytes that are not the request message a method takes: every servex method answers INVALID_ARGUMENT naming the
message type (not grpcio's UNKNOWN naming a Python class), counts the call, logs no traceback, and serves on; in a
ModelStreamInfer stream that one request gets the error and the stream goes on."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.support.daemon import metric

GARBAGE = b"\xff\xff\xff\xff"  # a field header whose varint never ends


@pytest.fixture(scope="module")
def daemon(half_daemon):
    """half_plus_two (TF1) as ``half``: a daemon other modules share (this module's checks count from what they
    find)."""
    return half_daemon


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("/tensorflow.serving.PredictionService/Predict", "tensorflow.serving.PredictRequest"),
        ("/tensorflow.serving.PredictionService/Classify", "tensorflow.serving.ClassificationRequest"),
        ("/tensorflow.serving.ModelService/GetModelStatus", "tensorflow.serving.GetModelStatusRequest"),
        ("/tensorflow.serving.SessionService/SessionRun", "tensorflow.serving.SessionRunRequest"),
        ("/inference.GRPCInferenceService/ModelInfer", "inference.ModelInferRequest"),
        ("/servex.v1.GraphExecutor/Run", "servex.v1.RunRequest"),
    ],
)
def test_bytes_that_do_not_parse_are_invalid_argument_naming_the_message(daemon, method, message):
    name = method.rsplit("/", 1)[1]
    before = metric(daemon, "servex_requests_total", method=name, code="INVALID_ARGUMENT")
    call = daemon.channel.unary_unary(method)  # no serializer: the bytes go as they are
    with pytest.raises(grpc.RpcError) as info:
        call(GARBAGE, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"the request is not a valid {message} message")
    assert metric(daemon, "servex_requests_total", method=name, code="INVALID_ARGUMENT") == before + 1
    assert "Unexpected" not in daemon.log() and "Traceback" not in daemon.log()
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[1.0]], np.float32)))
    answer = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel).Predict(request, timeout=10)
    assert tf.make_ndarray(answer.outputs["y"]).ravel().tolist() == [2.5]


def test_a_message_that_does_not_parse_in_a_stream_is_that_request_s_error(daemon):
    from tritonclient.grpc import service_pb2

    good = service_pb2.ModelInferRequest(model_name="half")
    good.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    good.raw_input_contents.append(np.array([[2.0]], np.float32).tobytes())
    stream = daemon.channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    replies: queue.Queue = queue.Queue()
    for reply in stream(iter([good.SerializeToString(), GARBAGE, good.SerializeToString()]), timeout=30):
        replies.put(service_pb2.ModelStreamInferResponse.FromString(reply))
    first, bad, last = (replies.get_nowait() for _ in range(3))
    assert not first.error_message and np.frombuffer(first.infer_response.raw_output_contents[0], np.float32) == 3.0
    assert bad.error_message.startswith("the request is not a valid inference.ModelInferRequest")  # as Triton: no code
    assert not last.error_message
