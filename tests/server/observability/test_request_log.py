"""Request logging (server/observability/request_log.py): sampling, the TFRecord files and their rotation, the
bounded queue and its drops, write failures, and config updates, with the real writer thread writing real files
that tf.data reads back."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from prometheus_client import REGISTRY
from tensorflow_serving.apis import (
    classification_pb2,
    inference_pb2,
    predict_pb2,
    prediction_log_pb2,
    regression_pb2,
    session_service_pb2,
)
from tensorflow_serving.config import logging_config_pb2

from servex.loader.config import LoggingSpec, ModelSpec
from servex.server.observability import request_log
from servex.server.observability.request_log import RequestLogger, RequestLogs, TFRecordFiles


def spec(prefix, rate: float = 1.0) -> LoggingSpec:
    sampling = logging_config_pb2.SamplingConfig(sampling_rate=rate).SerializeToString()
    return LoggingSpec(str(prefix), rate, "tfrecord", sampling)


@pytest.fixture
def loggers():
    """Make RequestLoggers; each is closed (its writer ended) at the end of the test."""
    made: list[RequestLogger] = []

    def make(logging_spec: LoggingSpec, **kwargs) -> RequestLogger:
        logger = RequestLogger(logging_spec, **kwargs)
        made.append(logger)
        return logger

    yield make
    for logger in made:
        logger.close(None)


def files(prefix) -> list[str]:
    return sorted(str(p) for p in prefix.parent.glob(f"{prefix.name}-*.tfrecord"))


def records(paths) -> list[prediction_log_pb2.PredictionLog]:
    if not paths:
        return []
    return [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(list(paths))]


def counted(model: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("servex_request_log_records_total", {"model": model, "outcome": outcome}) or 0.0


def predict_pair(i: int, model: str = "m") -> tuple[predict_pb2.PredictRequest, predict_pb2.PredictResponse]:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([float(i)], np.float32)))
    response = predict_pb2.PredictResponse()
    response.model_spec.name = model
    response.model_spec.version.value = 7
    response.model_spec.signature_name = "serving_default"
    response.outputs["y"].CopyFrom(tf.make_tensor_proto(np.array([i / 2 + 2], np.float32)))
    return request, response


# -- records --------------------------------------------------------------------------------------------------


def test_every_call_is_logged_at_rate_one_and_reads_back(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix, 1.0))
    before = counted("rate-one", "written")
    sent = [predict_pair(i, "rate-one") for i in range(50)]
    assert all(logger.log("rate-one", "predict_log", request, response) for request, response in sent)
    assert logger.drain(60)
    logged = records(files(prefix))
    assert [(r.predict_log.request, r.predict_log.response) for r in logged] == sent
    metadata = logged[0].log_metadata
    assert metadata.model_spec.name == "rate-one"
    assert metadata.model_spec.version.value == 7
    assert metadata.model_spec.signature_name == "serving_default"
    assert metadata.sampling_config.sampling_rate == 1.0
    assert list(metadata.saved_model_tags) == ["serve"]
    assert metadata.timestamp_secs > 0
    assert counted("rate-one", "written") - before == 50


def test_nothing_is_logged_at_rate_zero(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix, 0.0))
    request, response = predict_pair(1)
    assert not any(logger.log("rate-zero", "predict_log", request, response) for _ in range(2000))
    assert logger.drain(60)
    assert files(prefix) == []
    assert sum(counted("rate-zero", outcome) for outcome in request_log.OUTCOMES) == 0


def test_a_fraction_of_calls_is_sampled(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix, 0.25), rng=random.Random(20240517), capacity=4000)  # room for every one
    request, response = predict_pair(1)
    calls = 4000
    queued = sum(logger.log("fraction", "predict_log", request, response) for _ in range(calls))
    # Binomial(4000, 0.25): mean 1000, standard deviation 27.4; the seeded draw is fixed, and any fair draw would
    # land within 6 standard deviations
    assert 1000 - 165 < queued < 1000 + 165
    assert logger.drain(60)
    assert len(records(files(prefix))) == queued


def test_the_sampling_config_is_carried_in_each_record(tmp_path, loggers):
    prefix = tmp_path / "requests"
    sampling = logging_config_pb2.SamplingConfig(sampling_rate=1.0, attributes=3)
    logger = loggers(LoggingSpec(str(prefix), 1.0, "tfrecord", sampling.SerializeToString()))
    logger.log("m", "predict_log", *predict_pair(1))
    assert logger.drain(60)
    (record,) = records(files(prefix))
    assert record.log_metadata.sampling_config == sampling


def kinds_of_calls():
    """A request and response of each kind of record, as the gRPC API answers them."""
    classify = classification_pb2.ClassificationRequest()
    classify.model_spec.name = "k"
    classify.input.example_list.examples.add().features.feature["x"].float_list.value.append(2.0)
    classified = classification_pb2.ClassificationResponse()
    classified.model_spec.name, classified.model_spec.signature_name = "k", "classify_x_to_y"
    classified.model_spec.version.value = 3
    classified.result.classifications.add().classes.add(score=3.0)
    regress = regression_pb2.RegressionRequest()
    regress.model_spec.name = "k"
    regress.input.CopyFrom(classify.input)
    regressed = regression_pb2.RegressionResponse()
    regressed.model_spec.CopyFrom(classified.model_spec)
    regressed.model_spec.signature_name = "regress_x_to_y"
    regressed.result.regressions.add(value=3.0)
    multi = inference_pb2.MultiInferenceRequest()
    multi.tasks.add(method_name="tensorflow/serving/regress").model_spec.name = "k"
    multi.input.CopyFrom(classify.input)
    answered = inference_pb2.MultiInferenceResponse()
    answered.results.add().model_spec.CopyFrom(regressed.model_spec)
    session = session_service_pb2.SessionRunRequest(fetch=["y:0"])
    session.model_spec.name = "k"
    ran = session_service_pb2.SessionRunResponse()
    ran.model_spec.name = "k"
    ran.model_spec.version.value = 3
    ran.tensor.add(name="y:0").tensor.CopyFrom(tf.make_tensor_proto(np.float32(3.0)))
    return {
        "predict_log": predict_pair(4, "k"),
        "classify_log": (classify, classified),
        "regress_log": (regress, regressed),
        "multi_inference_log": (multi, answered),
        "session_run_log": (session, ran),
    }


def test_each_kind_of_call_becomes_its_prediction_log(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix))
    calls = kinds_of_calls()
    for kind, (request, response) in calls.items():
        logger.log("k", kind, request, response)
    assert logger.drain(60)
    logged = records(files(prefix))
    assert [r.WhichOneof("log_type") for r in logged] == list(calls)
    for record, (kind, (request, response)) in zip(logged, calls.items(), strict=True):
        assert getattr(record, kind).request == request
        assert getattr(record, kind).response == response
        spec_logged = record.log_metadata.model_spec
        assert (spec_logged.name, spec_logged.version.value) == ("k", 7 if kind == "predict_log" else 3)
    by_kind = {r.WhichOneof("log_type"): r.log_metadata.model_spec.signature_name for r in logged}
    assert by_kind["classify_log"] == "classify_x_to_y"
    assert by_kind["multi_inference_log"] == ""  # several signatures: each result names its own


def test_a_record_built_by_the_writer(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix))
    built = []

    def build():
        built.append(True)
        return predict_pair(9, "built")

    assert logger.submit("built", "predict_log", build)
    assert logger.drain(60)
    (record,) = records(files(prefix))
    assert (record.predict_log.request, record.predict_log.response) == predict_pair(9, "built")
    assert built == [True]


def test_a_record_that_cannot_be_built_is_counted_failed(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix))
    before = counted("unbuildable", "failed")

    def broken():
        raise ValueError("no")

    logger.submit("unbuildable", "predict_log", broken)
    logger.log("unbuildable", "predict_log", *predict_pair(1, "unbuildable"))
    assert logger.drain(60)
    assert counted("unbuildable", "failed") - before == 1
    assert len(records(files(prefix))) == 1  # the next record is written


# -- files ----------------------------------------------------------------------------------------------------


def test_files_rotate_by_size(tmp_path, loggers):
    request, response = predict_pair(1, "rotate")
    one = loggers(spec(tmp_path / "one"))  # how many bytes a record of this call takes in a file
    one.log("rotate", "predict_log", request, response)
    assert one.drain(60)
    (path,) = files(tmp_path / "one")
    record_bytes = Path(path).stat().st_size
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix), max_file_bytes=3 * record_bytes)
    for _ in range(10):
        logger.log("rotate", "predict_log", request, response)
    assert logger.drain(60)
    paths = files(prefix)
    assert [len(records([p])) for p in paths] == [3, 3, 3, 1]  # a file is closed once it holds max_file_bytes
    assert [p.rsplit("-", 1)[1] for p in paths] == ["00000.tfrecord", "00001.tfrecord", "00002.tfrecord",
                                                    "00003.tfrecord"]  # fmt: skip
    assert [Path(p).stat().st_size for p in paths] == [3 * record_bytes] * 3 + [record_bytes]


def test_file_names_skip_files_that_exist(tmp_path):
    prefix = str(tmp_path / "taken")
    first = request_log.next_path(prefix)
    assert first.startswith(f"{prefix}-") and first.endswith(".tfrecord")
    pid, number = first[len(prefix) + 1 : -len(".tfrecord")].split("-")
    assert int(pid) > 0
    (tmp_path / f"taken-{pid}-{int(number) + 1:05d}.tfrecord").write_bytes(b"")  # another's, e.g. a reused pid
    assert request_log.next_path(prefix) == f"{prefix}-{pid}-{int(number) + 2:05d}.tfrecord"


def test_tfrecord_files_are_whole_after_each_flush(tmp_path):
    prefix = tmp_path / "flush"
    out = TFRecordFiles(str(prefix))
    out.write(b"one")
    out.flush()
    assert [r.numpy() for r in tf.data.TFRecordDataset(files(prefix))] == [b"one"]  # readable while open
    out.write(b"two")
    out.close()
    assert [r.numpy() for r in tf.data.TFRecordDataset(files(prefix))] == [b"one", b"two"]


# -- the queue ------------------------------------------------------------------------------------------------


def test_records_are_dropped_and_counted_when_the_writer_falls_behind(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix), capacity=3)
    dropped, written = counted("behind", "dropped"), counted("behind", "written")
    sent = [predict_pair(i, "behind") for i in range(8)]
    with logger.writing:  # the writer cannot take a record until this is released
        queued = [logger.log("behind", "predict_log", request, response) for request, response in sent]
        assert queued == [True] * 3 + [False] * 5  # the caller never waits: the queue is full, the record dropped
        assert counted("behind", "dropped") - dropped == 5
    assert logger.drain(60)
    assert [r.predict_log.request for r in records(files(prefix))] == [request for request, _ in sent[:3]]
    assert counted("behind", "written") - written == 3


def test_close_writes_what_is_queued(tmp_path, loggers):
    prefix = tmp_path / "requests"
    logger = loggers(spec(prefix))
    with logger.writing:
        for i in range(4):
            logger.log("closing", "predict_log", *predict_pair(i, "closing"))
        logger.close(0.0)
        assert not logger.log("closing", "predict_log", *predict_pair(9, "closing"))  # closed: taken no more
    assert logger.join(60)
    assert len(records(files(prefix))) == 4


def test_a_write_that_fails_is_counted_and_the_next_file_is_tried(tmp_path, loggers, caplog):
    folder = tmp_path / "logs"
    folder.mkdir()
    prefix = folder / "requests"
    logger = loggers(spec(prefix))
    failed = counted("unwritable", "failed")
    shutil.rmtree(folder)  # the folder is gone: the file cannot be opened
    logger.log("unwritable", "predict_log", *predict_pair(1, "unwritable"))
    assert logger.drain(60)
    assert counted("unwritable", "failed") - failed == 1
    assert any("requests" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    folder.mkdir()
    logger.log("unwritable", "predict_log", *predict_pair(2, "unwritable"))
    assert logger.drain(60)
    assert [r.predict_log.request for r in records(files(prefix))] == [predict_pair(2, "unwritable")[0]]


# -- the models' loggers --------------------------------------------------------------------------------------


def test_updates_keep_unchanged_loggers_and_close_the_others(tmp_path):
    logs = RequestLogs()
    a, b = spec(tmp_path / "a"), spec(tmp_path / "b")
    try:
        logs.update([ModelSpec("m1", "/m1", logging=a), ModelSpec("m2", "/m2", logging=a), ModelSpec("m3", "/m3")])
        first = logs.get("m1")
        assert first is not None and logs.get("m2") is first  # one config, one logger
        assert logs.get("m3") is None and logs.get("nope") is None
        logs.update([ModelSpec("m1", "/m1", logging=a), ModelSpec("m2", "/m2", logging=b)])
        assert logs.get("m1") is first and not first.closed  # unchanged: the same logger, its files and queue
        second = logs.get("m2")
        assert second is not first
        logs.update([ModelSpec("m1", "/m1"), ModelSpec("m2", "/m2", logging=b)])  # m1's logging_config removed
        assert logs.get("m1") is None and first.closed and first.join(60)
        assert logs.get("m2") is second
        logs.update([])
        assert logs.by_model == {} and second.closed
    finally:
        logs.close()
