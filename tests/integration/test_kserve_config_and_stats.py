"""Triton's model configuration and inference statistics (tritonclient's get_model_config and
get_inference_statistics) from the real daemon, over gRPC (ModelConfig, ModelStatistics: parsed by tritonclient's
own messages) and REST (GET /v2/models/{name}/config, .../stats): platform, version policy, inputs and outputs,
batching as Triton states it (max_batch_size > 0: dims without the batch dimension) with batching on and off;
statistics counting the rows, runs, successes and failures that happened; unknown models, bad versions and empty
names answered as errors."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tensorflow as tf
import tritonclient.grpc as triton
import tritonclient.http as httpclient
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import COUNTER, HALF_PLUS_TWO_TF2, TESTDATA
from tests.integration.conftest import export_sum
from tests.support.daemon import Daemon
from tests.support.models import export_strings

TWO_VERSIONS = TESTDATA / "saved_model_half_plus_two_2_versions"


def start(tmp_path_factory, mlp_model, *flags):
    base = tmp_path_factory.mktemp("config_models")
    export_sum(base / "sum")
    export_strings(base / "strings")
    config = base / "models.config"
    config.write_text(
        "model_config_list {\n"
        f'  config {{ name: "mlp" base_path: "{mlp_model}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "sum" base_path: "{base / "sum"}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "strings" base_path: "{base / "strings"}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "tf2" base_path: "{HALF_PLUS_TWO_TF2}" model_platform: "tensorflow"\n'
        "           model_version_policy { specific { versions: 123 } } }\n"
        f'  config {{ name: "two" base_path: "{TWO_VERSIONS}" model_platform: "tensorflow"\n'
        "           model_version_policy { all {} } }\n"
        "}\n"
    )
    return Daemon([f"--model_config_file={config}", *flags], tmp_path_factory.mktemp("servex"), rest=True)


@pytest.fixture(scope="module")
def batching(tmp_path_factory, mlp_model):
    params = tmp_path_factory.mktemp("batching") / "batching.pbtxt"
    params.write_text("max_batch_size { value: 16 }\nallowed_batch_sizes: [4, 8, 16]\n")
    daemon = start(tmp_path_factory, mlp_model, f"--batching_parameters_file={params}")
    yield daemon.wait_serving()
    daemon.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory, mlp_model):
    daemon = start(tmp_path_factory, mlp_model)
    yield daemon.wait_serving()
    daemon.stop()


def grpc_config(daemon: Daemon, name: str, version: str = "") -> dict:
    with triton.InferenceServerClient(daemon.address) as client:
        return client.get_model_config(name, version, as_json=True)["config"]


def http_config(daemon: Daemon, name: str, version: str = "") -> dict:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}", network_timeout=30)
    try:
        return client.get_model_config(name, version)
    finally:
        client.close()


MLP_BATCHED = {
    "name": "mlp",
    "platform": "tensorflow_savedmodel",
    "backend": "tensorflow",
    "version_policy": {"latest": {"num_versions": 1}},
    "max_batch_size": 16,
    "input": [
        {
            "name": "features",
            "data_type": "TYPE_FP32",
            "format": "FORMAT_NONE",
            "dims": [64],
            "is_shape_tensor": False,
            "allow_ragged_batch": False,
            "optional": False,
        }
    ],
    "output": [
        {"name": "score", "data_type": "TYPE_FP32", "dims": [1], "label_filename": "", "is_shape_tensor": False}
    ],
    "dynamic_batching": {"preferred_batch_size": [4, 8, 16], "max_queue_delay_microseconds": 0},
}


def test_rest_config_of_a_batched_model_is_tritons_json(batching):
    assert http_config(batching, "mlp") == MLP_BATCHED
    assert http_config(batching, "mlp", "1") == MLP_BATCHED


def test_grpc_config_of_a_batched_model_parses_as_tritons_message(batching):
    with triton.InferenceServerClient(batching.address) as client:
        config = client.get_model_config("mlp").config  # tritonclient's own ModelConfig class, from the wire
    assert (config.name, config.platform, config.max_batch_size) == ("mlp", "tensorflow_savedmodel", 16)
    assert config.version_policy.latest.num_versions == 1
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("features", 11, [64])]  # 11: TYPE_FP32
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [("score", 11, [1])]
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8, 16]


def test_outputs_without_the_batch_dimension_are_not_batched(batching):
    config = grpc_config(batching, "sum")
    assert config.get("max_batch_size", 0) == 0 and "dynamic_batching" not in config
    dims = {o["name"]: [int(d) for d in o.get("dims", [])] for o in config["output"]}
    assert dims == {"doubled": [-1, 3], "total": []}
    assert http_config(batching, "sum")["max_batch_size"] == 0


def test_without_batching_dims_are_whole_shapes(plain):
    config = http_config(plain, "mlp")
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    assert [i["dims"] for i in config["input"]] == [[-1, 64]]
    assert [o["dims"] for o in config["output"]] == [[-1, 1]]
    assert grpc_config(plain, "mlp").get("max_batch_size", 0) == 0


def test_version_policies_and_data_types(plain):
    assert http_config(plain, "tf2")["version_policy"] == {"specific": {"versions": [123]}}
    assert http_config(plain, "two")["version_policy"] == {"all": {}}
    assert http_config(plain, "two", "123")["name"] == "two"
    strings = http_config(plain, "strings")
    assert [(i["name"], i["data_type"], i["dims"]) for i in strings["input"]] == [("text", "TYPE_STRING", [-1])]
    assert sorted((o["name"], o["data_type"]) for o in strings["output"]) == [
        ("length", "TYPE_INT32"),
        ("upper", "TYPE_STRING"),
    ]


@pytest.mark.parametrize(
    ("method", "name", "version", "status", "words"),
    [
        ("get_model_config", "nope", "", "NOT_FOUND", "Request for unknown model: 'nope' is not served (served "
         "models: mlp, strings, sum, tf2, two)"),
        ("get_model_config", "tf2", "7", "NOT_FOUND", "model 'tf2' has no version 7"),
        ("get_model_config", "mlp", "x1", "INVALID_ARGUMENT", "'x1' is not a version number"),
        ("get_inference_statistics", "nope", "", "NOT_FOUND", "Request for unknown model: 'nope' is not served"),
        ("get_inference_statistics", "tf2", "7", "NOT_FOUND", "model 'tf2' has no version 7"),
        ("get_inference_statistics", "", "1", "INVALID_ARGUMENT", "version 1 was given without a model name"),
    ],
)  # fmt: skip
def test_grpc_errors_name_what_was_wrong(plain, method, name, version, status, words):
    with triton.InferenceServerClient(plain.address) as client:
        with pytest.raises(InferenceServerException) as info:
            getattr(client, method)(name, version)
    assert info.value.status() == f"StatusCode.{status}"
    assert words in info.value.message()


def test_grpc_empty_name_is_invalid(plain):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(plain.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelConfig(service_pb2.ModelConfigRequest(name=""), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "name is empty" in info.value.details()


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/v2/models/nope/config", 404, "Request for unknown model: 'nope' is not served"),
        ("/v2/models/tf2/versions/7/config", 404, "model 'tf2' has no version 7"),
        ("/v2/models/mlp/versions/x1/config", 400, "'x1' is not a version number"),
    ],
)
def test_rest_errors_name_what_was_wrong(plain, path, status, words):
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(plain.rest_url + path, timeout=30)
    assert info.value.code == status
    assert words in json.loads(info.value.read())["error"]
    assert http_config(plain, "mlp")["name"] == "mlp"  # and the daemon goes on serving


# -- statistics -------------------------------------------------------------------------------------------


def infer_mlp(client, rows: int, columns: int = 64):
    tensor = triton.InferInput("features", [rows, columns], "FP32")
    tensor.set_data_from_numpy(np.ones((rows, columns), np.float32))
    return client.infer("mlp", [tensor])


def test_statistics_count_what_ran(batching):
    with triton.InferenceServerClient(batching.address) as client:
        before = time.time() * 1000
        for _ in range(5):
            infer_mlp(client, 1)
        infer_mlp(client, 3)
        with pytest.raises(InferenceServerException):
            infer_mlp(client, 1, columns=5)  # the wrong shape: an answered failure, nothing run
        stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("mlp", "1")]
    mlp = stats[0]
    assert before <= int(mlp["last_inference"]) <= time.time() * 1000
    assert (int(mlp["inference_count"]), int(mlp["execution_count"])) == (8, 6)  # rows, runs
    figures = mlp["inference_stats"]
    for what in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert int(figures[what]["count"]) == 6, what  # successes only: the failure decoded, nothing ran
        assert int(figures[what]["ns"]) > 0, what
    assert int(figures["fail"]["count"]) == 1
    inside = sum(int(figures[w]["ns"]) for w in ("compute_input", "compute_infer", "compute_output"))
    assert int(figures["success"]["ns"]) > inside  # the call includes its decoding, run and encoding
    assert [(int(b["batch_size"]), int(b["compute_infer"]["count"])) for b in mlp["batch_stats"]] == [(1, 6)]


def test_tritons_metric_names_on_metrics_say_what_the_statistics_say(batching):
    """Triton's nv_inference_* on /metrics (dashboards written for Triton): the same figures as ModelStatistics,
    by model and version, counters without _total as Triton names them."""
    from prometheus_client.parser import text_string_to_metric_families

    with triton.InferenceServerClient(batching.address) as client:
        infer_mlp(client, 2)
        with pytest.raises(InferenceServerException):
            infer_mlp(client, 1, columns=5)
        stats = client.get_inference_statistics("mlp", "1", as_json=True)["model_stats"][0]
        text = urllib.request.urlopen(f"http://127.0.0.1:{batching.metrics_port}/metrics", timeout=10).read().decode()
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("nv_inference_") and s.labels == {"model": "mlp", "version": "1"}
    }
    figures = stats["inference_stats"]
    assert samples["nv_inference_request_success"] == int(figures["success"]["count"]) >= 1
    assert samples["nv_inference_request_failure"] == int(figures["fail"]["count"]) >= 1
    assert samples["nv_inference_count"] == int(stats["inference_count"]) >= 2
    assert samples["nv_inference_exec_count"] == int(stats["execution_count"]) >= 1
    for name, what in (("queue", "queue"), ("compute_input", "compute_input"), ("compute_infer", "compute_infer"),
                       ("compute_output", "compute_output")):  # fmt: skip
        assert samples[f"nv_inference_{name}_duration_us"] == int(figures[what]["ns"]) // 1000 > 0, name
    both = int(figures["success"]["ns"]) + int(figures["fail"]["ns"])
    assert samples["nv_inference_request_duration_us"] == both // 1000
    assert "# TYPE nv_inference_request_success untyped" in text and "nv_inference_request_success_total" not in text


def test_statistics_over_rest_and_of_every_model(batching):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{batching.rest_port}", network_timeout=30)
    try:
        x = httpclient.InferInput("x", [2, 3], "FP32")
        x.set_data_from_numpy(np.ones((2, 3), np.float32))
        client.infer("sum", [x])
        sum_stats = client.get_inference_statistics("sum", "1")["model_stats"]
        every = client.get_inference_statistics()["model_stats"]
    finally:
        client.close()
    assert len(sum_stats) == 1
    assert (sum_stats[0]["inference_count"], sum_stats[0]["execution_count"]) == (2, 1)
    assert sum_stats[0]["inference_stats"]["success"]["count"] == 1
    for what in ("compute_input", "compute_output"):  # the JSON and binary tensors' decoding and encoding
        assert sum_stats[0]["inference_stats"][what]["count"] == 1, what
        assert sum_stats[0]["inference_stats"][what]["ns"] > 0, what
    assert sum_stats[0]["batch_stats"][0]["compute_input"] == {"count": 0, "ns": 0}  # not work of the batch
    served = {(s["name"], s["version"]) for s in every}
    assert {("mlp", "1"), ("sum", "1"), ("strings", "1"), ("tf2", "123"), ("two", "123"), ("two", "124")} == served


def test_tensorflow_serving_predict_calls_count_their_decoding_and_encoding_too(plain):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "two"
    request.model_spec.version.value = 124
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([1.0, 2.0], np.float32)))
    reply = prediction_service_pb2_grpc.PredictionServiceStub(plain.channel).Predict(request, timeout=30)
    assert tf.make_ndarray(reply.outputs["y"]).shape == (2,)
    body = json.dumps({"instances": [1.0, 2.0, 3.0]}).encode()
    rest = urllib.request.Request(f"{plain.rest_url}/v1/models/two/versions/124:predict", data=body, method="POST")
    with urllib.request.urlopen(rest, timeout=30) as answer:
        assert len(json.loads(answer.read())["predictions"]) == 3
    with triton.InferenceServerClient(plain.address) as client:
        (two,) = client.get_inference_statistics("two", "124", as_json=True)["model_stats"]
    figures = two["inference_stats"]
    for what in ("success", "compute_input", "compute_infer", "compute_output"):
        assert int(figures[what]["count"]) == 2, what  # the gRPC call and the REST one
        assert int(figures[what]["ns"]) > 0, what


def test_a_model_without_serving_default_is_described_with_no_tensors(tmp_path_factory):
    # saved_model_counter has only named signatures (incr_counter, get_counter, ...): it is ready, and its
    # metadata and config say so instead of failing the way a malformed request would.
    args = [f"--model_base_path={COUNTER}", "--model_name=counter"]
    daemon = Daemon(args, tmp_path_factory.mktemp("servex"), rest=True).wait_serving()
    try:
        with triton.InferenceServerClient(daemon.address) as client:
            assert client.is_model_ready("counter")
            metadata = client.get_model_metadata("counter", as_json=True)
            assert metadata["name"] == "counter" and "inputs" not in metadata and "outputs" not in metadata
        for config in (grpc_config(daemon, "counter"), http_config(daemon, "counter")):
            assert config["name"] == "counter" and config.get("max_batch_size", 0) == 0
            assert not config.get("input") and not config.get("output")
    finally:
        daemon.stop()
