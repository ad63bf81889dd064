"""SavedModel warm-up (``assets.extra/tf_serving_warmup_requests``), through the real daemon, on copies of
TensorFlow Serving's half_plus_two (TF1) with warm-up records written here with TensorFlow's TFRecordWriter."""

from __future__ import annotations

import time

import grpc
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    prediction_log_pb2,
    session_service_pb2,
)

from servex.protos.servex.v1 import variables_pb2
from tests.support.clients import (
    CLASSIFY,
    REGRESS,
    admin_stub,
    call,
    classify_request,
    multi_request,
    predict_request,
    regress_request,
)
from tests.support.daemon import metric, model_config_file
from tests.support.models import WARMUP_VERSION as VERSION
from tests.support.models import as_log, model_with_warmup
from tests.support.paths import HALF_PLUS_TWO_TF1

__all__ = ["VERSION", "as_log", "model_with_warmup", "predict_request"]  # (test_tfserving_command_line.py's)


def client_calls(model: str) -> list:
    """The calls the warm-up file holds, as a client would make them."""
    return [
        predict_request(model, [1.0, 2.0]),
        classify_request(model, "classify_x_to_y"),
        regress_request(model, "regress_x_to_y2"),
        multi_request([("classify_x_to_y", CLASSIFY), ("regress_x_to_y", REGRESS)], model),
    ]


def variable_states(admin_port: int, model: str) -> dict[str, str]:
    request = variables_pb2.ListVariablesRequest()
    request.model.name = model
    reply = admin_stub(admin_port).ListVariables(request, timeout=10)
    return {v.name: variables_pb2.Variable.State.Name(v.state) for v in reply.variables}


@pytest.fixture(scope="module")
def warm_and_cold(start_daemon, tmp_path_factory):
    """The same model with the same warm-up file, served with warm-up (2 iterations) and without."""
    # The records name another model and version: warm-up ignores both, as TensorFlow Serving does.
    records = [as_log(r).SerializeToString() for r in client_calls("renamed")]
    base = model_with_warmup(tmp_path_factory.mktemp("warm"), records)
    admin = ["--admin_port"]
    warm = start_daemon(f"--model_base_path={base}", "--model_name=hp2", "--num_request_iterations_for_warmup=2",
                        port_flags=admin, wait=False)  # fmt: skip
    cold = start_daemon(f"--model_base_path={base}", "--model_name=hp2", "--enable_model_warmup=false",
                        port_flags=admin, wait=False)  # fmt: skip
    warm.wait_serving()  # both start at once
    cold.wait_serving()
    return (warm, warm.admin_port), (cold, cold.admin_port)


def test_warm_up_runs_every_record_before_the_version_serves(warm_and_cold):
    (warm, warm_admin), (cold, cold_admin) = warm_and_cold
    # Before any client call, warm-up has built client graphs, run and restored only what the records read...
    assert metric(warm, "servex_requests_total", model="hp2") == 0  # warm-up is no client's request
    built, runs = (metric(warm, f"servex_{m}", model="hp2") for m in ("client_graph_builds_total", "run_seconds_count"))
    warmed = variable_states(warm_admin, "hp2")
    assert built > 0 and "ON_DEVICE" in warmed.values() and "UNRESTORED" in warmed.values()
    assert "warmed up with 4 records x 2" in warm.log()
    # ...and without warm-up, nothing ran and nothing was read.
    assert metric(cold, "servex_client_graph_builds_total", model="hp2") == 0
    assert set(variable_states(cold_admin, "hp2").values()) == {"UNRESTORED"}
    # The same calls from a client leave the cold daemon where warm-up (twice each) left the warm one.
    for request in client_calls("hp2"):
        call(cold.channel, request)
    assert variable_states(cold_admin, "hp2") == warmed
    assert metric(cold, "servex_client_graph_builds_total", model="hp2") == built
    assert metric(cold, "servex_run_seconds_count", model="hp2") * 2 == runs
    # On the warm daemon, the client's calls find their client graphs built, and get the model's answers.
    answers = [call(warm.channel, request) for request in client_calls("hp2")]
    assert metric(warm, "servex_client_graph_builds_total", model="hp2") == built
    assert tf.make_ndarray(answers[0].outputs["y"]).tolist() == [2.5, 3.0]
    assert answers[0].model_spec.version.value == VERSION


def wait_for_error(channel, model: str, timeout: float = 60) -> str:
    """The error GetModelStatus reports for the model's version once its load has failed."""
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = model
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            (status,) = stub.GetModelStatus(request, timeout=10).model_version_status
        except grpc.RpcError:
            status = None
        if status is not None and status.status.error_message:
            return status.status.error_message
        time.sleep(0.1)
    raise AssertionError(f"model {model!r} did not fail to load within {timeout}s")


def test_a_failing_or_unreadable_warm_up_fails_the_load_and_says_why(start_daemon, tmp_path_factory):
    good = predict_request("any", [1.0])
    bad_alias = predict_request("any", {"nope": [1.0]})
    session_run = prediction_log_pb2.PredictionLog()
    session_run.session_run_log.request.CopyFrom(session_service_pb2.SessionRunRequest())
    root = tmp_path_factory.mktemp("bad")
    models = {
        "good": HALF_PLUS_TWO_TF1,
        "bad_record": model_with_warmup(root / "bad_record", [as_log(good).SerializeToString(),
                                                              as_log(bad_alias).SerializeToString()]),
        "not_a_log": model_with_warmup(root / "not_a_log", [b"\xff\xfe not a PredictionLog"]),
        "unsupported": model_with_warmup(root / "unsupported", [session_run.SerializeToString()]),
        "damaged": model_with_warmup(root / "damaged", [as_log(good).SerializeToString()]),
    }  # fmt: skip
    damaged = root / "damaged" / str(VERSION) / "assets.extra" / "tf_serving_warmup_requests"
    data = damaged.read_bytes()
    damaged.write_bytes(data[:-6] + b"garbge")  # the record's checksum no longer matches
    config = model_config_file(tmp_path_factory.mktemp("config"), models)
    daemon = start_daemon(f"--model_config_file={config}")

    error = wait_for_error(daemon.channel, "bad_record")
    assert "warm-up record 1 (predict_log) failed" in error and "'nope'" in error and "'x'" in error
    error = wait_for_error(daemon.channel, "not_a_log")
    assert "record 0 is not a PredictionLog" in error and "tf_serving_warmup_requests" in error
    error = wait_for_error(daemon.channel, "unsupported")
    assert "session_run_log is not supported for warm-up" in error and "predict_log" in error
    error = wait_for_error(daemon.channel, "damaged")
    assert "not a readable TFRecord file" in error
    # The other models serve on.
    assert tf.make_ndarray(call(daemon.channel, predict_request("good", [4.0])).outputs["y"]).tolist() == [4.0]
    with pytest.raises(grpc.RpcError) as info:
        call(daemon.channel, predict_request("bad_record", [1.0]))
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
