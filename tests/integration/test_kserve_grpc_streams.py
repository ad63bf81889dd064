"""KServe v2's gRPC streams (ModelStreamInfer) through the real daemon, called with tritonclient.grpc and its raw
stub, on the models of tests/integration/test_kserve_grpc.py: answers in request order, each final, failed ones
naming their request (or ending the stream with ``triton_grpc_error``), and a stream's requests batched together."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import HALF_PLUS_TWO_TF1
from tests.integration import test_kserve_grpc as kserve_grpc
from tests.support.clients import infer_input
from tests.support.daemon import metric, model_config_file
from tests.support.v2_requests import fp32_request

# test_kserve_grpc.py's daemon and clients (this module starts its own)
models, served, client, stub = kserve_grpc.models, kserve_grpc.served, kserve_grpc.client, kserve_grpc.stub


def test_stream_answers_in_order_and_survives_an_error(client):
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for value, model in [(1.0, "tf1"), (2.0, "nope"), (3.0, "tf1"), (4.0, "tf2")]:
            shape = (1,) if model == "tf2" else (1, 1)
            x = np.full(shape, value, np.float32)
            client.async_stream_infer(model, [infer_input("x", x)], request_id=str(value))
        got = [answers.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    (r1, e1), (r2, e2), (r3, e3), (r4, e4) = got
    assert e1 is None and r1.as_numpy("y").ravel().tolist() == [2.5] and r1.get_response().id == "1.0"
    assert r2 is None and str(e2).startswith("Request for unknown model: 'nope' is not served")  # Triton's words
    assert e3 is None and r3.as_numpy("y").ravel().tolist() == [3.5]
    assert e4 is None and r4.as_numpy("y").ravel().tolist() == [4.0]


def test_stream_answers_are_final_and_failed_ones_name_their_request(client, stub):
    # Triton's stream clients wait for triton_final_response (tritonclient: enable_empty_final_response=True).
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("tf1", [infer_input("x", np.ones((1, 1), np.float32))], request_id="a",
                                  enable_empty_final_response=True)  # fmt: skip
        result, error = answers.get(timeout=30)
    finally:
        client.stop_stream()
    assert error is None and result.get_response().parameters["triton_final_response"].bool_param
    requests = [fp32_request(), fp32_request(model="nope")]
    requests[0].id, requests[1].id = "ok-1", "bad-2"
    good, bad = list(stub.ModelStreamInfer(iter(requests), timeout=30))
    assert good.infer_response.id == "ok-1" and good.infer_response.parameters["triton_final_response"].bool_param
    # the message alone, as Triton answers it (clients look for "Request for unknown model")
    assert bad.error_message.startswith("Request for unknown model: 'nope' is not served")
    assert (bad.infer_response.id, bad.infer_response.model_name) == ("bad-2", "nope")
    assert bad.infer_response.parameters["triton_final_response"].bool_param


def test_an_unknown_model_is_named_as_triton_s_own_client_examples_expect(client):
    # Triton's simple_grpc_* examples check `"Request for unknown model" in ex.message()` (metadata) and
    # `ex.message().startswith("Request for unknown model")` (infer)
    with pytest.raises(InferenceServerException) as metadata:
        client.get_model_metadata("wrong_model_name")
    with pytest.raises(InferenceServerException) as infer:
        client.infer("wrong_model_name", [infer_input("x", np.array([[1.0]], np.float32))])
    for error in (metadata.value, infer.value):
        assert error.status() == "StatusCode.NOT_FOUND"
        assert error.message().startswith("Request for unknown model: 'wrong_model_name' is not served")


def test_triton_grpc_error_metadata_ends_the_stream_with_the_error_s_status(stub):
    requests = [fp32_request(), fp32_request(model="nope"), fp32_request()]
    answers = stub.ModelStreamInfer(iter(requests), timeout=30, metadata=[("triton_grpc_error", "true")])
    first = next(answers)
    assert not first.error_message and first.infer_response.outputs[0].name == "y"
    with pytest.raises(grpc.RpcError) as info:
        next(answers)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'nope' is not served" in info.value.details()


def test_a_stream_s_requests_run_together_and_batch_their_answers_in_order(start_daemon, tmp_path, slow_model):
    """The requests of one stream queue as separate calls do: behind a slow one holding the only worker, the next
    ones wait together and run as batches; every answer is still its own, in request order."""
    config = model_config_file(tmp_path, {"slow": slow_model, "hp": HALF_PLUS_TWO_TF1})
    daemon = start_daemon(f"--model_config_file={config}", "--enable_batching", "--num_run_workers=1", "--xla=false")
    slow = service_pb2.ModelInferRequest(model_name="slow", id="slow")
    slow.inputs.add(name="iterations", datatype="INT64", shape=[]).contents.int64_contents.append(600_000)
    requests = [slow] + [fp32_request(model="hp", values=(float(i),)) for i in range(16)]
    for i, request in enumerate(requests[1:]):
        request.id = f"hp-{i}"
    streams = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
    answers = list(streams.ModelStreamInfer(iter(requests), timeout=60))
    assert [a.error_message for a in answers] == [""] * len(requests)
    assert [a.infer_response.id for a in answers] == [r.id for r in requests]
    ys = [np.frombuffer(a.infer_response.raw_output_contents[0], np.float32)[0] for a in answers[1:]]
    assert ys == [0.5 * i + 2 for i in range(16)]
    assert metric(daemon, "servex_batch_size_count", model="hp") == 16
    assert metric(daemon, "servex_batch_size_sum", model="hp") > 16  # batched: sequential requests never batch
