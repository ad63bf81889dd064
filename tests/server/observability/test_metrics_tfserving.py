"""server/observability/metrics.py's TFServingNames: TensorFlow Serving's and TensorFlow's metric names, made at scrape
time from
servex's own metric objects (the real ones, read through a real prometheus_client registry and the text
exposition a scraper parses). Each test uses model names of its own: the metric objects are the process's."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servex.executor.metrics import QUEUE_WAIT, RUN_SECONDS, RunMetrics
from servex.server.observability.metrics import (
    MODEL_LOAD_FAILURES,
    MODEL_LOAD_SECONDS,
    REQUEST_LATENCY,
    REQUESTS,
    TFServingNames,
    exposition,
    model_load,
    recorder,
)

_names = itertools.count()


@pytest.fixture
def model() -> str:
    return f"tfs_names_{next(_names)}"


def scrape(batching: bool = False) -> dict:
    """TFServingNames over a registry of servex's metric objects, as a scraper parses it: families by name."""
    source = CollectorRegistry(auto_describe=True)
    for metric in (REQUESTS, REQUEST_LATENCY, RUN_SECONDS, QUEUE_WAIT, MODEL_LOAD_SECONDS, MODEL_LOAD_FAILURES):
        source.register(metric)
    names = CollectorRegistry()
    names.register(TFServingNames(source, batching))
    text = generate_latest(names).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, **labels: str) -> dict[str, list]:
    """The family's samples whose labels include ``labels``, by sample name."""
    found: dict[str, list] = {}
    for sample in family.samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            found.setdefault(sample.name, []).append(sample)
    return found


def call(method: str, model: str, version: str = "1", signature: str = "serving_default", *, run: float = 0.002):
    """One answered call that ran: servex's request counter and latency, and the run's time and queue wait."""
    RunMetrics(model, version, signature, "0", {}).run_seconds.observe(run)
    RunMetrics(model, version, signature, "0", {}).queue_wait.observe(0.0003)
    recorder(method, model, version, signature, 0, "OK")(run + 0.001, 0.0, 0.0)


def test_request_count_and_latency_keep_their_names_and_labels(model):
    call("Predict", model)
    call("rest:predict", model)
    recorder("Predict", model, "1", "", 0, "INVALID_ARGUMENT")(0.0001, 0.0, 0.0)  # refused before any run
    recorder("ModelInfer", model, "1", "serving_default", 0, "OK")(0.001, 0.0, 0.0)  # not one of TF Serving's
    families = scrape()
    count = families[":tensorflow:serving:request_count"]
    assert count.type == "unknown"  # TensorFlow Serving's counter names have no _total
    found = {s.labels["status"]: s.value for s in count.samples if s.labels["model_name"] == model}
    assert found == {"OK": 2.0, "INVALID_ARGUMENT": 1.0}
    latency = families[":tensorflow:serving:request_latency"]
    assert latency.type == "histogram"
    grpc = samples(latency, model_name=model, API="Predict", entrypoint="GRPC")
    rest = samples(latency, model_name=model, API="Predict", entrypoint="REST")
    assert grpc[":tensorflow:serving:request_latency_count"][0].value == 2.0  # the refused call is timed too
    assert rest[":tensorflow:serving:request_latency_count"][0].value == 1.0
    assert rest[":tensorflow:serving:request_latency_sum"][0].value == pytest.approx(3000.0)  # 3 ms, in µs


def test_runtime_latency_is_servex_s_run_time_by_model_in_microseconds(model):
    for _ in range(3):
        call("Predict", model, run=0.002)
    call("rest:predict", model, version="2", run=0.004)  # another version, by REST: the same series
    latency = scrape()[":tensorflow:serving:runtime_latency"]
    assert latency.type == "histogram"
    assert latency.documentation == "Distribution of wall time (in microseconds) for Tensorflow runtime."
    mine = [s for s in latency.samples if s.labels.get("model_name") == model]
    assert {tuple(sorted(k for k in s.labels if k != "le")) for s in mine} == {("API", "model_name", "runtime")}
    found = samples(latency, model_name=model, API="Predict", runtime="TF1")
    assert found[":tensorflow:serving:runtime_latency_count"][0].value == 4.0
    assert found[":tensorflow:serving:runtime_latency_sum"][0].value == pytest.approx(3 * 2000.0 + 4000.0)
    buckets = {s.labels["le"]: s.value for s in found[":tensorflow:serving:runtime_latency_bucket"]}
    assert buckets["50.0"] == 0.0 and buckets["2500.0"] == 3.0 and buckets["5000.0"] == 4.0  # servex's, in µs
    assert buckets["+Inf"] == 4.0


def test_runtime_latency_names_the_api_that_ran_each_signature(model):
    call("Classify", model, signature="classify")
    call("Regress", model, signature="regress")
    call("Predict", model, signature="both")
    call("ModelInfer", model, signature="both")  # a KServe call ran the same signature: the runs are one series
    call("ModelInfer", model, signature="kserve_only")  # TensorFlow Serving has no such runs
    RunMetrics(model, "1", "warm_only", "0", {}).run_seconds.observe(0.001)  # a warm-up run, no call of its own
    latency = scrape()[":tensorflow:serving:runtime_latency"]
    counts = {
        s.labels["API"]: s.value
        for s in latency.samples
        if s.labels["model_name"] == model and s.name.endswith("_count")
    }
    assert counts == {"Classify": 1.0, "Regress": 1.0, "ModelInfer+Predict": 2.0}


def test_queuing_latency_only_with_batching(model):
    call("Predict", model)
    assert ":tensorflow:serving:batching_session:queuing_latency" not in scrape(batching=False)
    queuing = scrape(batching=True)[":tensorflow:serving:batching_session:queuing_latency"]
    assert queuing.type == "histogram"
    assert {s.labels["thread_pool_name"] for s in queuing.samples} == {""}  # TensorFlow Serving's model server
    total = samples(queuing)[":tensorflow:serving:batching_session:queuing_latency_count"][0].value
    wait_count = sum(
        s.value for m in QUEUE_WAIT.collect() for s in m.samples if s.name == "servex_queue_wait_seconds_count"
    )
    assert total == wait_count >= 1.0  # every run's wait, whichever model


def test_saved_model_load_metrics_by_version_path(model, tmp_path):
    good, bad = str(tmp_path / model / "1"), str(tmp_path / model / "2")
    model_load(model, 1, True, 0.25, good)
    model_load(model, 2, False, 0.1, bad)
    model_load(model, 2, False, 0.1, bad)  # a retry
    families = scrape()
    attempts = families[":tensorflow:cc:saved_model:load_attempt_count"]
    assert attempts.type == "unknown"
    found = {
        (s.labels["model_path"], s.labels["status"]): s.value
        for s in attempts.samples
        if s.labels["model_path"].startswith(str(tmp_path))
    }
    assert found == {(good, "success"): 1.0, (bad, "fail"): 2.0}
    latency = families[":tensorflow:cc:saved_model:load_latency"]
    assert latency.type == "unknown"
    found = {
        s.labels["model_path"]: s.value for s in latency.samples if s.labels["model_path"].startswith(str(tmp_path))
    }
    assert found == {good: pytest.approx(250_000.0), bad: 0.0}  # µs; servex does not time failed loads
    # servex's own load metrics keep their names, by model as before (and now by path as well)
    assert REGISTRY.get_sample_value("servex_model_load_seconds_count", {"model": model, "model_path": good}) == 1.0
    assert REGISTRY.get_sample_value("servex_model_load_failures_total", {"model": model, "model_path": bad}) == 2.0


def test_exposition_serves_servex_s_metrics_and_tensorflow_serving_s(model):
    call("Predict", model)
    model_load(model, 1, True, 0.5, f"/models/{model}/1")
    text = exposition(True, batching=True)[0].decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("servex_requests", "servex_run_seconds"):
        assert name in families  # servex's own, unchanged
    assert families[":tensorflow:serving:runtime_latency"].type == "histogram"
    assert families[":tensorflow:serving:batching_session:queuing_latency"].type == "histogram"
    assert (
        f':tensorflow:cc:saved_model:load_attempt_count{{model_path="/models/{model}/1",status="success"}} 1.0' in text
    )
    assert ":tensorflow:" not in exposition(False)[0].decode()  # --metrics_port: servex's names only
