"""Every dtype TensorFlow Serving accepts in Predict, through the real daemon, both wire forms.

The test exports a TF2 model whose signature echoes one input of each dtype (tf.identity), so what comes back is
what TensorFlow received: the request decoded and the response encoded by servex, checked against the input.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from servex.server.transport.tensors import fill_proto

DTYPES = {
    "f16": tf.float16,
    "bf16": tf.bfloat16,
    "f32": tf.float32,
    "f64": tf.float64,
    "i8": tf.int8,
    "i16": tf.int16,
    "i32": tf.int32,
    "i64": tf.int64,
    "u8": tf.uint8,
    "u16": tf.uint16,
    "u32": tf.uint32,
    "u64": tf.uint64,
    "b": tf.bool,
    "c64": tf.complex64,
    "c128": tf.complex128,
    "s": tf.string,
}


def sample(alias: str) -> np.ndarray:
    rng = np.random.default_rng(7)
    dtype = DTYPES[alias]
    if dtype == tf.string:
        return np.array([[b"a", b"\x00\xffbytes"], [b"", "unicode \u00e9".encode()]], dtype=object)
    if dtype == tf.bool:
        return np.array([[True, False], [False, True]])
    if dtype.is_complex:
        return (rng.standard_normal((2, 2)) + 1j * rng.standard_normal((2, 2))).astype(dtype.as_numpy_dtype)
    if dtype.is_floating:
        return (rng.standard_normal((2, 2)) * 100).astype(dtype.as_numpy_dtype)
    info = np.iinfo(dtype.as_numpy_dtype)
    return np.array([[info.min, info.max], [0, 1]], dtype=dtype.as_numpy_dtype)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, start_daemon):
    specs = [tf.TensorSpec([None, 2], dtype, name=alias) for alias, dtype in DTYPES.items()]

    class Echo(tf.Module):
        @tf.function(input_signature=specs)
        def serve(self, *inputs):
            return {alias: tf.identity(x) for alias, x in zip(DTYPES, inputs, strict=True)}

    base = tmp_path_factory.mktemp("echo")
    module = Echo()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return start_daemon(f"--model_base_path={base}", "--model_name=echo")


def _request(encode) -> predict_pb2.PredictRequest:
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "echo"
    for alias in DTYPES:
        req.inputs[alias].CopyFrom(encode(sample(alias)))
    return req


def _typed(value: np.ndarray) -> tensor_pb2.TensorProto:
    proto = tensor_pb2.TensorProto()
    fill_proto(proto, value, tensor_content=False)
    return proto


@pytest.mark.parametrize("encode", [tf.make_tensor_proto, _typed], ids=["tensor_content", "typed_fields"])
def test_every_dtype_round_trips_through_predict(daemon, encode):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    reply = stub.Predict(_request(encode), timeout=30)
    assert set(reply.outputs) == set(DTYPES)
    for alias, dtype in DTYPES.items():
        got = tf.make_ndarray(reply.outputs[alias])
        want = sample(alias)
        assert reply.outputs[alias].dtype == dtype.as_datatype_enum, alias
        assert got.shape == want.shape, alias
        if dtype == tf.bfloat16:
            assert got.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got, want, err_msg=alias)
    # TensorFlow Serving answers in typed fields: no output is in tensor_content
    assert not any(reply.outputs[a].tensor_content for a in DTYPES)
