"""A tensorflow_model_server command line starts the real daemon: TensorFlow Serving's flags servex implements take
effect (gRPC channel arguments, the Prometheus path of --monitoring_config_file on the REST port, SavedModel tags,
--platform_config_file), and those that change nothing here are logged with the reason."""

from __future__ import annotations

import shutil
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.conftest import HALF_PLUS_TWO_TF1
from tests.support.daemon import metric, run_to_exit

METADATA_LIMIT = 4096  # the gRPC port's hard limit on a call's metadata, set through --grpc_channel_arguments


def predict(channel, model: str, x: np.ndarray) -> predict_pb2.PredictResponse:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)


def test_a_tensorflow_model_server_command_line_serves(start_daemon, tmp_path):
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text("prometheus_config { enable: true }")
    daemon = start_daemon(
        "--model_name=half",
        f"--model_base_path={HALF_PLUS_TWO_TF1}",
        "--rest_api_num_threads=8",
        "--flush_filesystem_caches=true",
        "--tensorflow_session_parallelism=2",
        "--enable_batching=false",
        f"--monitoring_config_file={monitoring}",
        f"--grpc_channel_arguments=grpc.max_metadata_size=2048,grpc.absolute_max_metadata_size={METADATA_LIMIT}",
        rest=True,
    )
    answer = predict(daemon.channel, "half", np.array([[1.0]], np.float32))
    assert tf.make_ndarray(answer.outputs["y"]).ravel().tolist() == [2.5]
    # The channel arguments are in effect: a call with more metadata than the limit is refused by gRPC.
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[1.0]], np.float32)))
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request, timeout=30, metadata=[("x-big", "a" * 2 * METADATA_LIMIT)])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {METADATA_LIMIT}" in info.value.details()
    # TensorFlow Serving's Prometheus path on the REST port: the same metrics as --metrics_port.
    with urllib.request.urlopen(f"{daemon.rest_url}/monitoring/prometheus/metrics", timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    assert 'servex_requests_total{code="OK",method="Predict",model="half"' in text
    # and TensorFlow Serving's own request metrics, under its names, for its dashboards and alerts
    assert ':tensorflow:serving:request_count{model_name="half",status="OK"} 1.0' in text
    buckets = [line for line in text.splitlines() if line.startswith(":tensorflow:serving:request_latency_bucket")]
    assert buckets and all('API="Predict",entrypoint="GRPC"' in line for line in buckets)
    assert buckets[-1].startswith(
        ':tensorflow:serving:request_latency_bucket{API="Predict",entrypoint="GRPC",le="+Inf"'
    )
    assert buckets[-1].endswith(" 1.0") and 'le="50.0"' in buckets[0]  # servex's 50 µs bucket, in microseconds
    # the model runtime's time of that one Predict, TensorFlow's load metrics of its one version, and no batching
    # queue (batching is off, as TensorFlow Serving has that metric only with it on)
    families = tf_serving_families(text)
    runtime = families[":tensorflow:serving:runtime_latency"]
    assert runtime.type == "histogram"
    assert series_labels(runtime) == {("API", "Predict"), ("model_name", "half"), ("runtime", "TF1")}
    assert sample(runtime, ":tensorflow:serving:runtime_latency_count") == 1.0
    request_us = sample(families[":tensorflow:serving:request_latency"], ":tensorflow:serving:request_latency_sum")
    assert 0 < sample(runtime, ":tensorflow:serving:runtime_latency_sum") < request_us  # µs, within the request's
    path = str(HALF_PLUS_TWO_TF1 / "00000123")
    attempts = families[":tensorflow:cc:saved_model:load_attempt_count"]
    assert attempts.type == "unknown"  # a counter without prometheus_client's _total, as TensorFlow Serving's
    assert series_labels(attempts) == {("model_path", path), ("status", "success")}
    assert sample(attempts, ":tensorflow:cc:saved_model:load_attempt_count") == 1.0
    latency = families[":tensorflow:cc:saved_model:load_latency"]
    assert series_labels(latency) == {("model_path", path)}
    assert 1_000 < sample(latency, ":tensorflow:cc:saved_model:load_latency") < 120e6  # µs: more than 1 ms, < 2 min
    assert ":tensorflow:serving:batching_session:queuing_latency" not in families
    log = daemon.log()
    assert "--rest_api_num_threads=8 has no effect in servex" in log
    assert "--flush_filesystem_caches=true has no effect in servex" in log


def test_tensorflow_serving_metric_names_with_batching_and_a_failed_load(start_daemon, tmp_path):
    """With batching on, TensorFlow Serving's batching queue latency too; a version that fails to load is counted
    under its own path."""
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text('prometheus_config { enable: true path: "/tfs/metrics" }')
    base = tmp_path / "model"
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", base / "1")
    daemon = start_daemon(
        "--model_name=half", f"--model_base_path={base}", "--enable_batching", f"--monitoring_config_file={monitoring}",
        "--file_system_poll_wait_seconds=0.2", "--max_num_load_retries=0", rest=True,
    )  # fmt: skip
    grpc_calls, rest_calls = 3, 2
    for _ in range(grpc_calls):
        predict(daemon.channel, "half", np.array([[1.0]], np.float32))
    for _ in range(rest_calls):
        call = urllib.request.Request(f"{daemon.rest_url}/v1/models/half:predict", data=b'{"instances": [[1.0]]}')
        with urllib.request.urlopen(call, timeout=10) as reply:
            assert reply.read() == b'{"predictions":[[2.5]]}'
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "saved_model.pb").write_bytes(b"not a SavedModel")
    (tmp_path / "staging").rename(base / "2")
    deadline = time.monotonic() + 60
    while metric(daemon, "servex_model_load_failures_total", model="half") < 1:
        assert time.monotonic() < deadline, f"version 2 never failed to load:\n{daemon.log()}"
        time.sleep(0.1)
    with urllib.request.urlopen(f"{daemon.rest_url}/tfs/metrics", timeout=10) as reply:
        families = tf_serving_families(reply.read().decode())
    calls = grpc_calls + rest_calls
    runtime = families[":tensorflow:serving:runtime_latency"]
    assert series_labels(runtime) == {("API", "Predict"), ("model_name", "half"), ("runtime", "TF1")}  # both
    assert sample(runtime, ":tensorflow:serving:runtime_latency_count") == calls
    queuing = families[":tensorflow:serving:batching_session:queuing_latency"]
    assert queuing.type == "histogram" and series_labels(queuing) == {("thread_pool_name", "")}
    assert sample(queuing, ":tensorflow:serving:batching_session:queuing_latency_count") == calls
    attempts = families[":tensorflow:cc:saved_model:load_attempt_count"]
    found = {(s.labels["model_path"], s.labels["status"]): s.value for s in attempts.samples}
    assert found == {(str(base / "1"), "success"): 1.0, (str(base / "2"), "fail"): 1.0}
    latency = {s.labels["model_path"]: s.value for s in families[":tensorflow:cc:saved_model:load_latency"].samples}
    assert latency[str(base / "1")] > 0 and latency[str(base / "2")] == 0.0  # servex does not time failed loads


def test_a_platform_config_file_sets_batching_session_config_tags_and_warm_up(start_daemon, tmp_path):
    """TensorFlow Serving's --platform_config_file, as its docs write one: its SessionBundleConfig turns batching on
    and warm-up on (twice per record), and names the tags; the flags it replaces are ignored, as in TensorFlow
    Serving (these would leave batching and warm-up off, and load no MetaGraphDef at all)."""
    from tests.integration.test_warmup import VERSION, as_log, model_with_warmup, predict_request

    base = model_with_warmup(tmp_path / "model", [as_log(predict_request("any", [1.0, 2.0])).SerializeToString()])
    platform = tmp_path / "platform.config"
    platform.write_text(
        """platform_configs {
  key: "tensorflow"
  value {
    source_adapter_config {
      [type.googleapis.com/tensorflow.serving.SavedModelBundleSourceAdapterConfig] {
        legacy_config {
          session_config { intra_op_parallelism_threads: 1 inter_op_parallelism_threads: 1 }
          batching_parameters { max_batch_size { value: 8 } batch_timeout_micros { value: 0 } }
          saved_model_tags: "serve"
          enable_model_warmup: true
          model_warmup_options { num_request_iterations { value: 2 } }
        }
      }
    }
  }
}"""
    )
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text("prometheus_config { enable: true }")
    daemon = start_daemon(
        "--model_name=half", f"--model_base_path={base}", f"--platform_config_file={platform}",
        f"--monitoring_config_file={monitoring}", "--enable_batching=false", "--enable_model_warmup=false",
        "--saved_model_tags=no_such_tag", rest=True,
    )  # fmt: skip
    calls = 3
    for i in range(calls):
        answer = predict(daemon.channel, "half", np.array([[float(i)]], np.float32))
        assert tf.make_ndarray(answer.outputs["y"]).ravel().tolist() == [0.5 * i + 2]
    log = daemon.log()
    assert f"model 'half' version {VERSION}: warmed up with 1 records x 2" in log
    for flag in ("--enable_batching", "--enable_model_warmup", "--saved_model_tags"):
        assert f"{flag} is ignored: --platform_config_file's SessionBundleConfig replaces it" in log
    # Batching is on: TensorFlow Serving's batching queue metric counts the clients' calls and warm-up's two runs
    # (warm-up goes through the same queue, as in TensorFlow Serving); it is absent with batching off.
    with urllib.request.urlopen(f"{daemon.rest_url}/monitoring/prometheus/metrics", timeout=10) as reply:
        families = tf_serving_families(reply.read().decode())
    queuing = families[":tensorflow:serving:batching_session:queuing_latency"]
    assert sample(queuing, ":tensorflow:serving:batching_session:queuing_latency_count") == calls + 2


def tf_serving_families(text: str) -> dict:
    """The TensorFlow-named metric families of an exposition, by name, as prometheus_client's parser reads them."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith(":tensorflow:")}


def series_labels(family) -> set[tuple[str, str]]:
    """Every (label, value) of the family's series, ``le`` aside."""
    return {(k, v) for s in family.samples for k, v in s.labels.items() if k != "le"}


def sample(family, name: str) -> float:
    """The one sample called ``name`` (the family has one series)."""
    (value,) = [s.value for s in family.samples if s.name == name]
    return value


def test_saved_model_tags_pick_the_meta_graph(start_daemon, tmp_path):
    base = tmp_path / "tagged"
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        y = tf.identity(x * 3.0, name="y")
        builder = tf.compat.v1.saved_model.Builder(str(base / "1"))
        signature = tf.compat.v1.saved_model.predict_signature_def({"x": x}, {"y": y})
        builder.add_meta_graph_and_variables(session, ["tpu_free", "custom"], {"serving_default": signature})
        builder.save()
    daemon = start_daemon("--model_name=tagged", f"--model_base_path={base}", "--saved_model_tags=custom,tpu_free")
    answer = predict(daemon.channel, "tagged", np.array([2.0], np.float32))
    assert tf.make_ndarray(answer.outputs["y"]).tolist() == [6.0]
    # With TensorFlow Serving's default tag ("serve") the model does not load, and the error names the tags.
    out = run_to_exit(["--model_name=tagged", f"--model_base_path={base}"])
    assert out.returncode == 1 and "with tags ['serve']" in out.stderr


def test_rest_api_enable_cors_support_lets_browser_pages_of_other_origins_call(start_daemon):
    daemon = start_daemon(
        "--model_name=half", f"--model_base_path={HALF_PLUS_TWO_TF1}", "--rest_api_enable_cors_support", rest=True
    )
    url = f"{daemon.rest_url}/v1/models/half:predict"
    preflight = urllib.request.Request(
        url,
        method="OPTIONS",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, x-servex-priority",
        },
    )
    with urllib.request.urlopen(preflight, timeout=10) as reply:
        assert reply.status == 204
        assert reply.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in reply.headers["Access-Control-Allow-Methods"]
        assert reply.headers["Access-Control-Allow-Headers"] == "content-type, x-servex-priority"
    call = urllib.request.Request(url, data=b'{"instances": [[1.0]]}', headers={"Origin": "https://app.example"})
    with urllib.request.urlopen(call, timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Access-Control-Allow-Origin"] == "*"
        assert reply.read() == b'{"predictions":[[2.5]]}'
    bad = urllib.request.Request(f"{daemon.rest_url}/v1/models/nope:predict", data=b'{"instances": [1.0]}')
    with pytest.raises(urllib.error.HTTPError) as info:  # errors carry it too, so the page can read them
        urllib.request.urlopen(bad, timeout=10)
    assert info.value.code == 404 and info.value.headers["Access-Control-Allow-Origin"] == "*"


def test_without_cors_support_no_cors_headers_are_sent(start_daemon):
    daemon = start_daemon("--model_name=half", f"--model_base_path={HALF_PLUS_TWO_TF1}", rest=True)
    call = urllib.request.Request(f"{daemon.rest_url}/v1/models/half:predict", data=b'{"instances": [[1.0]]}')
    with urllib.request.urlopen(call, timeout=10) as reply:
        assert reply.status == 200 and "Access-Control-Allow-Origin" not in reply.headers
