"""Large requests and answers through the real daemon. Typed values past tensors.OFF_LOOP_ELEMENTS decode and
encode on a worker thread (TensorFlow Serving's Predict, KServe v2 typed contents, servex.v1 Run) and come back
exact. Answers and error messages that gRPC would not carry: an answer larger than
--max_message_bytes is RESOURCE_EXHAUSTED from servex (counted so, not logged as a servicer failure), also in the
middle of a ModelStreamInfer stream that goes on; an error message listing thousands of names is cut, so the
client gets the real status instead of gRPC's own RESOURCE_EXHAUSTED for an oversized trailer."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import tensorflow as tf
import tritonclient.grpc as triton
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.support.clients import infer_input, predict_request
from tests.support.daemon import metric, model_config_file
from tests.support.paths import HALF_PLUS_TWO_TF1

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def daemon(start_daemon, tmp_path_factory, strings_model):
    base = tmp_path_factory.mktemp("limits")
    config = model_config_file(base, {"half": HALF_PLUS_TWO_TF1, "strings": strings_model})
    return start_daemon(f"--model_config_file={config}", f"--max_message_bytes={LIMIT}")


def test_an_answer_over_the_limit_is_resource_exhausted_from_servex(daemon):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    # One value broadcast over 262,144 rows: 1 MiB decoded (within the limit), but the answer's float_val
    # take 1 MiB and then some.
    x = tf.make_tensor_proto([1.0], dtype=tf.float32, shape=[LIMIT // 4, 1])
    before = metric(daemon, "servex_requests_total", method="Predict", code="RESOURCE_EXHAUSTED")
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(predict_request("half", x), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the answer to Predict is " in info.value.details()
    assert f"more than the limit of {LIMIT} bytes (--max_message_bytes)" in info.value.details()
    assert metric(daemon, "servex_requests_total", method="Predict", code="RESOURCE_EXHAUSTED") == before + 1
    assert "ExecuteBatchError" not in daemon.log()
    # and the daemon answers the next caller
    answer = stub.Predict(predict_request("half", tf.make_tensor_proto(np.array([[1.0]], np.float32))), timeout=30)
    assert tf.make_ndarray(answer.outputs["y"]).ravel().tolist() == [2.5]


def test_an_oversized_answer_in_a_stream_is_that_request_s_error_and_the_stream_goes_on(daemon):
    # 200,000 one-byte strings take 1,000,000 bytes in; their upper-cased copies and lengths 1,800,000 out.
    big = np.array([b"a"] * 200_000, dtype=object)
    small = np.array([b"ab", b"c"], dtype=object)
    answers: queue.Queue = queue.Queue()
    with triton.InferenceServerClient(daemon.address) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            for i, text in enumerate([small, big, small]):
                client.async_stream_infer("strings", [infer_input("text", text, "BYTES")], request_id=str(i))
            got = [answers.get(timeout=60) for _ in range(3)]
        finally:
            client.stop_stream()
    (r0, e0), (r1, e1), (r2, e2) = got
    assert e0 is None and r0.as_numpy("length").tolist() == [2, 1]
    assert r1 is None and str(e1).startswith("the answer to ModelStreamInfer is")  # as Triton: the message alone
    assert e2 is None and r2.as_numpy("upper").tolist() == [b"AB", b"C"]


def test_an_error_message_naming_thousands_of_outputs_is_cut_and_keeps_its_status(daemon):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    x = tf.make_tensor_proto(np.array([[1.0]], np.float32))
    request = predict_request("half", x, output_filter=[f"output_{i}" for i in range(5000)])
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not gRPC's "metadata size exceeds" instead
    details = info.value.details()
    assert "output_filter names unknown output(s) ['output_0', 'output_1'" in details
    assert details.endswith("more characters)") and len(details) < 4200


def test_an_error_message_of_non_ascii_characters_is_cut_as_grpc_encodes_it(daemon):
    # gRPC percent-encodes the message: a CJK character takes 9 bytes, so 2,000 of them (within 4,096
    # characters) would pass gRPC's 16 KiB trailer limit and turn into its own RESOURCE_EXHAUSTED.
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    request = predict_request("half", tf.make_tensor_proto(np.array([[1.0]], np.float32)))
    request.model_spec.name = "模" * 2000
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    details = info.value.details()
    assert details.startswith("Servable not found for request: Latest(模模") and details.endswith("more characters)")


def test_large_typed_requests_and_answers_round_trip(daemon):
    x = np.arange(200_000, dtype=np.float32).reshape(-1, 1)  # past OFF_LOOP_ELEMENTS both ways
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    request = predict_request("half", tf.make_tensor_proto(x))
    request.inputs["x"].ClearField("tensor_content")
    request.inputs["x"].float_val.extend(x.ravel().tolist())  # typed values, as some clients send
    answer = stub.Predict(request, timeout=60)
    np.testing.assert_array_equal(tf.make_ndarray(answer.outputs["y"]), 0.5 * x + 2)
    assert len(answer.outputs["y"].float_val) == x.size  # answered in typed values, every one
    request = service_pb2.ModelInferRequest(model_name="half")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    reply = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel).ModelInfer(request, timeout=60)
    assert not reply.outputs[0].contents.ListFields()  # typed in, raw out (as Triton answers)
    np.testing.assert_array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), (0.5 * x + 2).ravel())


def test_broadcast_inputs_are_bounded_together_and_checked_against_the_model_first(daemon):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    rows = int(LIMIT * 0.4) // 4  # one float broadcast over 40% of the limit: each input alone is within it

    def request(model: str, inputs: int) -> predict_pb2.PredictRequest:
        r = predict_pb2.PredictRequest()
        r.model_spec.name = model
        for i in range(inputs):
            r.inputs[f"junk{i}"].CopyFrom(tf.make_tensor_proto([1.0], dtype=tf.float32, shape=[rows]))
        return r

    # A few hundred bytes asking for 3 x 40% of the limit: refused at the third, before it is made.
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request("half", 3), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        f"decodes to {rows * 4} bytes from 1 value(s); with the request's other broadcast inputs ({2 * rows * 4} "
        in (info.value.details())
    )
    # Named to a model that is not served: NOT_FOUND before anything is decoded (the bound is not even reached).
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request("nope", 3), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in info.value.details()
    answer = stub.Predict(predict_request("half", tf.make_tensor_proto(np.array([[1.0]], np.float32))), timeout=30)
    assert tf.make_ndarray(answer.outputs["y"]).ravel().tolist() == [2.5]
