"""TensorFlow Serving's request logging on the real daemon: a model's logging_config (sampling_rate 1.0) writes a
PredictionLog record of every Predict, Classify, Regress, MultiInference and SessionRun call (gRPC) and every REST
predict, classify and regress call, read back here with tf.data from the TFRecord files; and a config reload that
changes or removes a logging_config takes effect."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import input_pb2, prediction_log_pb2, session_service_pb2

from tests.support.clients import (
    CLASSIFY,
    REGRESS,
    SESSION_RUN,
    call,
    classify_request,
    example,
    multi_request,
    predict_request,
    regress_request,
)
from tests.support.daemon import metric, wait_for
from tests.support.paths import HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2

pytestmark = pytest.mark.integration


def logging_config(prefix: Path | None) -> str:
    if prefix is None:
        return ""
    return (
        f'logging_config {{ log_collector_config {{ type: "tfrecord" filename_prefix: "{prefix}" }} '
        "sampling_config { sampling_rate: 1.0 } }"
    )


def write_config(path: Path, models: dict[str, tuple[Path, Path | None]]) -> Path:
    """A model config file serving each name from its base path, logging to its prefix (None: not logged); written
    whole at once, so that a poll never reads it half-written."""
    entries = "".join(
        f'  config {{ name: "{name}" base_path: "{base}" model_platform: "tensorflow" {logging_config(prefix)} }}\n'
        for name, (base, prefix) in models.items()
    )
    scratch = path.with_suffix(".new")
    scratch.write_text(f"model_config_list {{\n{entries}}}\n")
    os.replace(scratch, path)
    return path


def records(prefix: Path) -> list[prediction_log_pb2.PredictionLog] | None:
    """Every record in the files of ``prefix``, in order (None while the last one is being written)."""
    paths = sorted(str(p) for p in prefix.parent.glob(f"{prefix.name}-*.tfrecord"))
    if not paths:
        return []
    try:
        return [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(paths)]
    except tf.errors.DataLossError:
        return None


def wait_records(prefix: Path, count: int) -> list[prediction_log_pb2.PredictionLog]:
    return wait_for(lambda: (found := records(prefix)) is not None and len(found) >= count and found,
                    what=f"{count} records under {prefix}")  # fmt: skip


def rest(daemon, path: str, body: dict) -> dict:
    request = urllib.request.Request(daemon.rest_url + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def session_run(daemon, request: session_service_pb2.SessionRunRequest) -> session_service_pb2.SessionRunResponse:
    run = daemon.channel.unary_unary(
        SESSION_RUN,
        request_serializer=session_service_pb2.SessionRunRequest.SerializeToString,
        response_deserializer=session_service_pb2.SessionRunResponse.FromString,
    )
    return run(request, timeout=30)


def assert_metadata(record, signature: str) -> None:
    spec = record.log_metadata.model_spec
    assert (spec.name, spec.version.value, spec.signature_name) == ("hp", 123, signature)
    assert record.log_metadata.sampling_config.sampling_rate == 1.0
    assert list(record.log_metadata.saved_model_tags) == ["serve"]


@pytest.fixture(scope="module")
def logged(start_daemon, tmp_path_factory):
    folder = tmp_path_factory.mktemp("request_logs")
    prefix = folder / "hp"
    config = write_config(folder / "models.config", {"hp": (HALF_PLUS_TWO_TF1, prefix)})
    return start_daemon(f"--model_config_file={config}", rest=True), prefix


def test_grpc_calls_are_logged_with_what_was_sent_and_answered(logged):
    daemon, prefix = logged
    before = len(records(prefix) or [])
    session = session_service_pb2.SessionRunRequest(fetch=["y"], tensor_name_is_alias=True)
    session.model_spec.name, session.model_spec.signature_name = "hp", "serving_default"
    session.feed.add(name="x").tensor.CopyFrom(tf.make_tensor_proto(np.array([[5.0]], np.float32)))
    sent = [
        predict_request("hp", np.array([[2.0], [4.0]], np.float32)),
        classify_request("hp", "classify_x_to_y", xs=(2.0,)),
        regress_request("hp", "regress_x_to_y2", xs=(3.0, 1.0)),
        multi_request([("classify_x_to_y", CLASSIFY), ("regress_x_to_y", REGRESS)], "hp", xs=(6.0,)),
    ]
    answers = [call(daemon.channel, request) for request in sent] + [session_run(daemon, session)]
    sent.append(session)
    logs = wait_records(prefix, before + len(sent))[before:]
    kinds = ["predict_log", "classify_log", "regress_log", "multi_inference_log", "session_run_log"]
    assert [r.WhichOneof("log_type") for r in logs] == kinds
    for record, kind, request, answer in zip(logs, kinds, sent, answers, strict=True):
        assert getattr(record, kind).request == request, kind
        assert getattr(record, kind).response == answer, kind
    signatures = ["serving_default", "classify_x_to_y", "regress_x_to_y2", "", "serving_default"]
    for record, signature in zip(logs, signatures, strict=True):
        assert_metadata(record, signature)


def test_rest_calls_are_logged_as_the_grpc_requests_they_stand_for(logged):
    daemon, prefix = logged
    before = len(records(prefix) or [])
    predicted = rest(daemon, "/v1/models/hp:predict", {"instances": [[1.0], [3.0]]})
    classified = rest(daemon, "/v1/models/hp/versions/123:classify",
                      {"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}]})  # fmt: skip
    regressed = rest(daemon, "/v1/models/hp:regress",
                     {"signature_name": "regress_x_to_y", "context": {"z": 1.0}, "examples": [{"x": 5.0}]})  # fmt: skip
    predict_log, classify_log, regress_log = wait_records(prefix, before + 3)[before:]

    request, response = predict_log.predict_log.request, predict_log.predict_log.response
    assert (request.model_spec.name, request.model_spec.signature_name) == ("hp", "")
    assert not request.model_spec.HasField("version")
    np.testing.assert_array_equal(tf.make_ndarray(request.inputs["x"]), np.array([[1.0], [3.0]], np.float32))
    assert tf.make_ndarray(response.outputs["y"]).tolist() == predicted["predictions"]
    assert_metadata(predict_log, "serving_default")

    request, response = classify_log.classify_log.request, classify_log.classify_log.response
    assert (request.model_spec.version.value, request.model_spec.signature_name) == (123, "classify_x_to_y")
    assert request.input == input_pb2.Input(example_list=input_pb2.ExampleList(examples=[example(x=2.0)]))
    assert [[["", c.score] for c in row.classes] for row in response.result.classifications] == classified["results"]
    assert_metadata(classify_log, "classify_x_to_y")

    request, response = regress_log.regress_log.request, regress_log.regress_log.response
    with_context = request.input.example_list_with_context
    assert with_context.context == example(z=1.0) and list(with_context.examples) == [example(x=5.0)]
    assert [r.value for r in response.result.regressions] == regressed["results"]
    assert_metadata(regress_log, "regress_x_to_y")


def test_written_records_are_counted(logged):
    daemon, prefix = logged
    count = len(wait_records(prefix, 1))
    wait_for(lambda: metric(daemon, "servex_request_log_records_total", model="hp", outcome="written") == count,
             what="the written records counted")  # fmt: skip
    assert metric(daemon, "servex_request_log_records_total", model="hp", outcome="dropped") == 0


def _x_values(logs) -> list[float]:
    return [float(tf.make_ndarray(r.predict_log.request.inputs["x"]).ravel()[0]) for r in logs]


def test_a_config_reload_changes_and_removes_logging(start_daemon, tmp_path):
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    config = write_config(
        tmp_path / "models.config", {"hp": (HALF_PLUS_TWO_TF1, first), "hp2": (HALF_PLUS_TWO_TF2, None)}
    )
    daemon = start_daemon(f"--model_config_file={config}", "--model_config_file_poll_wait_seconds=0.2")
    values = iter(range(1, 10_000))

    def predict(model: str) -> float:
        x = float(next(values))
        call(daemon.channel, predict_request(model, np.array([[x]] if model == "hp" else [x], np.float32)))
        return x

    logged_first = predict("hp")
    wait_records(first, 1)
    # hp's logging_config removed, hp2's added: once hp2's calls are logged, the new config is in effect
    write_config(config, {"hp": (HALF_PLUS_TWO_TF1, None), "hp2": (HALF_PLUS_TWO_TF2, second)})
    wait_for(lambda: predict("hp2") and records(second), what="hp2's calls logged")
    after_removal = [predict("hp") for _ in range(3)]
    # hp2's logging_config changed: a new prefix
    write_config(config, {"hp": (HALF_PLUS_TWO_TF1, None), "hp2": (HALF_PLUS_TWO_TF2, third)})
    wait_for(lambda: predict("hp2") and records(third), what="hp2's calls logged under the new prefix")
    after_change = [predict("hp2") for _ in range(3)]
    assert daemon.stop() == 0  # what is queued is written at exit

    assert _x_values(records(first)) == [logged_first]  # hp's calls after the removal are not logged
    assert not set(after_removal) & set(_x_values(records(second)) + _x_values(records(third)))
    in_second, in_third = _x_values(records(second)), _x_values(records(third))
    assert set(after_change) <= set(in_third) and not set(after_change) & set(in_second)
    assert max(in_second) < min(in_third)  # every call after the change went to the new files
