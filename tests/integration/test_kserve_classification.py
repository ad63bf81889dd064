"""Triton's classification extension on the real daemon: an output requested with ``class_count`` (tritonclient's
InferRequestedOutput, gRPC and REST) comes back as its top N classes, "value:index" strings, largest first, per
batch row; other outputs of the same call stay numbers; what cannot be classified is refused with the reason."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tensorflow as tf
import tritonclient.grpc as triton
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.support.daemon import Daemon

X = np.array([[0.1, 0.7, 0.2, 0.9], [0.5, 0.4, 0.3, 0.2]], np.float32)
TOP2 = [[b"0.900000:3", b"0.700000:1"], [b"0.500000:0", b"0.400000:1"]]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    class Scores(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def serve(self, x):
            return {"probs": tf.identity(x), "votes": tf.cast(x * 10, tf.int32), "total": tf.reduce_sum(x)}

    base = tmp_path_factory.mktemp("scores")
    module = Scores()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    daemon = Daemon(["--model_name=scores", f"--model_base_path={base}"], tmp_path_factory.mktemp("servex"), rest=True)
    yield daemon.wait_serving()
    daemon.stop()


def grpc_infer(daemon: Daemon, outputs):
    x = triton.InferInput("x", list(X.shape), "FP32")
    x.set_data_from_numpy(X)
    with triton.InferenceServerClient(daemon.address) as client:
        return client.infer("scores", [x], outputs=outputs)


def http_infer(daemon: Daemon, outputs, binary: bool):
    x = httpclient.InferInput("x", list(X.shape), "FP32")
    x.set_data_from_numpy(X, binary_data=binary)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}", network_timeout=30)
    try:
        return client.infer("scores", [x], outputs=outputs)
    finally:
        client.close()


def test_grpc_top_classes_per_row(daemon):
    outputs = [triton.InferRequestedOutput("probs", class_count=2), triton.InferRequestedOutput("votes")]
    result = grpc_infer(daemon, outputs)
    assert result.get_output("probs").datatype == "BYTES"
    assert result.as_numpy("probs").tolist() == TOP2
    np.testing.assert_array_equal(result.as_numpy("votes"), (X * 10).astype(np.int32))  # not classified


def test_more_classes_than_there_are_gives_them_all_and_integers_print_as_integers(daemon):
    result = grpc_infer(daemon, [triton.InferRequestedOutput("votes", class_count=10)])
    assert result.as_numpy("votes").tolist() == [[b"9:3", b"7:1", b"2:2", b"1:0"], [b"5:0", b"4:1", b"3:2", b"2:3"]]


@pytest.mark.parametrize("binary", [True, False])
def test_rest_top_classes_per_row(daemon, binary):
    outputs = [httpclient.InferRequestedOutput("probs", binary_data=binary, class_count=2)]
    result = http_infer(daemon, outputs, binary)
    assert result.get_output("probs")["datatype"] == "BYTES"
    # tritonclient gives BYTES as bytes from binary data and as str from JSON
    text = [[v.decode() if isinstance(v, bytes) else v for v in row] for row in result.as_numpy("probs").tolist()]
    assert text == [[v.decode() for v in row] for row in TOP2]


def test_an_output_without_classes_is_refused(daemon):
    with pytest.raises(InferenceServerException) as info:
        grpc_infer(daemon, [triton.InferRequestedOutput("total", class_count=1)])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "output 'total' cannot be classified: it is float32 of shape []" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        http_infer(daemon, [httpclient.InferRequestedOutput("total", class_count=1)], True)
    assert info.value.status() == "400" and "cannot be classified" in info.value.message()
    assert grpc_infer(daemon, [triton.InferRequestedOutput("probs", class_count=1)]).as_numpy("probs").shape == (2, 1)


@pytest.mark.parametrize(
    ("name", "set_param", "code", "words"),
    [
        ("classification", lambda p: setattr(p, "int64_param", 0), "INVALID_ARGUMENT",
         "output 'probs': parameter 'classification' is 0"),
        ("classification", lambda p: setattr(p, "string_param", "2"), "INVALID_ARGUMENT",
         "parameter 'classification' must be an integer"),
        ("shared_memory_region", lambda p: setattr(p, "string_param", "r"), "INVALID_ARGUMENT",
         "output 'probs': a shared memory region needs parameter 'shared_memory_byte_size'"),
        ("shared_memory_region", lambda p: setattr(p, "int64_param", 3), "INVALID_ARGUMENT",
         "output 'probs': parameter 'shared_memory_region' must be a string naming a region"),  # REST's words too
    ],
)  # fmt: skip
def test_grpc_bad_output_parameters(daemon, name, set_param, code, words):
    request = service_pb2.ModelInferRequest(model_name="scores")
    request.inputs.add(name="x", datatype="FP32", shape=list(X.shape))
    request.raw_input_contents.append(X.tobytes())
    set_param(request.outputs.add(name="probs").parameters[name])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == getattr(grpc.StatusCode, code)
    assert words in info.value.details()
