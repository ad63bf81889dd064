"""TensorFlow Serving's gRPC adapter (server/protocols/tfserving/grpc_api.py) in process: PredictionService and
ModelService over a ServingCore serving half_plus_two, called through real gRPC with tensorflow-serving-api's own
stubs, in milliseconds. The daemon tests (tests/integration/test_tfserving_*.py) cover the same API end to end."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from servex.server.protocols.tfserving.grpc_api import ModelService, PredictionService
from tests.support.in_process import aio_server, serving_core


@pytest.fixture(scope="module")
def channel():
    with serving_core("hp") as core:

        def add(server):
            prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
                PredictionService(core, False, 1 << 20), server
            )

            async def apply(specs):  # config changes are not what this module tests
                return []

            model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(core, apply, 1), server)

        with aio_server(add) as ch:
            yield ch


def predict(channel, model: str = "hp", **inputs) -> predict_pb2.PredictResponse:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)


def test_predict_answers_as_tensorflow_serving(channel):
    answer = predict(channel, x=np.array([[1.0], [4.0]], np.float32))
    assert answer.model_spec.name == "hp" and answer.model_spec.version.value == 123
    assert answer.model_spec.signature_name == "serving_default"
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["y"]), [[2.5], [4.0]])


def test_predict_errors_carry_the_status_and_name_what_was_wrong(channel):
    with pytest.raises(grpc.RpcError) as wrong_dtype:
        predict(channel, x=np.array([[1]], np.int64))
    assert wrong_dtype.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x'" in wrong_dtype.value.details() and "DT_FLOAT" in wrong_dtype.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        predict(channel, model="nope", x=np.array([[1.0]], np.float32))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.details()


def test_model_metadata_lists_the_signature(channel):
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "hp"
    answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(request, timeout=30)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    answer.metadata["signature_def"].Unpack(signatures)
    assert set(signatures.signature_def["serving_default"].inputs) == {"x"}


def test_model_status_reports_the_version_available(channel):
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "hp"
    answer = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(request, timeout=30)
    (status,) = answer.model_version_status
    assert status.version == 123 and status.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
