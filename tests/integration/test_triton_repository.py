"""A Triton model repository served by the real daemon started with Triton's command line (``--model-repository``),
called with tritonclient over gRPC and HTTP: models named by their folders, SavedModels in
``VERSION/model.savedmodel``, each config.pbtxt checked against its SavedModel, answered by ModelConfig completed
from it, and its dynamic_batching batching that model alone; a model that cannot be served is refused with the reason
(and stops the start, as Triton's --exit-on-error does, unless turned off); poll and explicit model control."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import export_sum
from tests.support.daemon import Daemon, free_port, run_to_exit

BATCHED_CONFIG = """
name: "batched"
platform: "tensorflow_savedmodel"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "doubled" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""
# The same without dynamic_batching: batches may come in whole (max_batch_size), servex forms none
UNBATCHED_CONFIG = "\n".join(
    line for line in BATCHED_CONFIG.splitlines() if not line.startswith(("name:", "dynamic_batching"))
)


@pytest.fixture(scope="module")
def saved_sum(tmp_path_factory) -> Path:
    """``export_sum``'s SavedModel (x [None,3] -> doubled, total), its folder."""
    base = tmp_path_factory.mktemp("sum")
    export_sum(base)
    return base / "1"


def add_model(repository: Path, name: str, saved_model: Path, config: str | None = None, version: int = 1) -> Path:
    folder = repository / name
    shutil.copytree(saved_model, folder / str(version) / "model.savedmodel")
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    return folder


@pytest.fixture(scope="module")
def saved_any_width(tmp_path_factory) -> Path:
    """x [None,None] float32 -> doubled: a SavedModel taking any width, its folder."""
    import tensorflow as tf

    class AnyWidth(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32, name="x")])
        def serve(self, x):
            return {"doubled": x * 2.0}

    folder = tmp_path_factory.mktemp("any_width") / "1"
    module = AnyWidth()
    tf.saved_model.save(module, str(folder), signatures={"serving_default": module.serve})
    return folder


@pytest.fixture(scope="module")
def repository(tmp_path_factory, saved_sum, saved_any_width, slow_model) -> Path:
    root = tmp_path_factory.mktemp("repository")
    add_model(root, "sum", saved_sum, 'platform: "tensorflow_savedmodel"\n')
    add_model(root, "batched", saved_sum, BATCHED_CONFIG)
    add_model(root, "unbatched", saved_sum, UNBATCHED_CONFIG)
    add_model(root, "slow", slow_model / "1")
    add_model(root, "auto", saved_any_width)  # no config.pbtxt: Triton's auto-complete gives it batching
    add_model(
        root,
        "three_wide",
        saved_any_width,
        'max_batch_size: 4 input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]',
    )
    return root


def start(tmp_path_factory, *args: str, rest: bool = True) -> Daemon:
    return Daemon(list(args), tmp_path_factory.mktemp("servex"), rest=rest).wait_serving()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, repository):
    daemon = start(tmp_path_factory, f"--model-repository={repository}", "--num_run_workers=1", "--xla=false")
    yield daemon
    daemon.stop()


def infer(client, model: str, value: np.ndarray, output: str = "doubled") -> np.ndarray:
    module = triton if isinstance(client, triton.InferenceServerClient) else httpclient
    tensor = module.InferInput("x", list(value.shape), "FP32")
    tensor.set_data_from_numpy(value)
    return client.infer(model, [tensor]).as_numpy(output)


def test_every_folder_serves_under_its_name_over_grpc_and_http(daemon):
    grpc_client = triton.InferenceServerClient(daemon.address)
    http_client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}")
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    for model in ("sum", "batched", "unbatched"):
        np.testing.assert_array_equal(infer(grpc_client, model, value), value * 2)
        np.testing.assert_array_equal(infer(http_client, model, value), value * 2)
        assert grpc_client.is_model_ready(model)
    assert grpc_client.is_server_ready() and http_client.is_server_ready()
    status = json.load(urllib.request.urlopen(f"{daemon.rest_url}/v1/models/batched", timeout=10))
    assert status["model_version_status"][0]["state"] == "AVAILABLE"


def test_the_config_is_the_contract_requests_are_checked_against(daemon):
    client = triton.InferenceServerClient(daemon.address)
    value = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(infer(client, "three_wide", value), value * 2)
    with pytest.raises(InferenceServerException, match=r"INVALID_ARGUMENT.*'x'.*\[-1,3\]"):
        infer(client, "three_wide", np.ones((2, 4), np.float32))  # the SavedModel takes any width, the file 3
    with pytest.raises(InferenceServerException, match=r"INVALID_ARGUMENT.*unknown output.*total.*doubled"):
        tensor = triton.InferInput("x", [1, 3], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 3), np.float32))
        client.infer("batched", [tensor], outputs=[triton.InferRequestedOutput("total")])  # not in its file
    metadata = client.get_model_metadata("batched", as_json=True)
    assert [(o["name"], o["shape"]) for o in metadata["outputs"]] == [("doubled", ["-1", "3"])]


def test_model_config_is_the_file_completed_from_the_savedmodel(daemon):
    grpc_client = triton.InferenceServerClient(daemon.address)
    http_client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}")
    for config in (grpc_client.get_model_config("batched", as_json=True)["config"],
                   http_client.get_model_config("batched")):  # fmt: skip
        assert config["name"] == "batched" and config["platform"] == "tensorflow_savedmodel"
        assert config["backend"] == "tensorflow" and config["default_model_filename"] == "model.savedmodel"
        assert int(config["max_batch_size"]) == 8
        assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 100
        assert config["instance_group"][0]["count"] == 2  # kept as written, though it changes nothing
        assert [(i["name"], [int(d) for d in i["dims"]]) for i in config["input"]] == [("x", [3])]
        # the file lists 'doubled' alone: the model's outputs are those it lists, as in Triton
        assert [o["name"] for o in config["output"]] == ["doubled"]
        assert config["version_policy"] == {"latest": {"num_versions": 1}}
    config = http_client.get_model_config("sum")  # a file naming the platform alone: everything from the SavedModel
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config  # 'total' has no batch dimension
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [("x", "TYPE_FP32", [-1, 3])]


def test_auto_complete_gives_a_batching_savedmodel_tritons_default_batching(daemon):
    config = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}").get_model_config("auto")
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config  # Triton's default-max-batch-size
    assert [(i["name"], i["dims"]) for i in config["input"]] == [("x", [-1])]
    client = triton.InferenceServerClient(daemon.address)
    runs_before, rows_before = _counts(daemon, "auto")
    held = _hold_the_worker(daemon)
    values = [np.full((1, 2), i, np.float32) for i in range(3)]
    results: dict[int, np.ndarray] = {}
    callers = [threading.Thread(target=lambda i=i: results.__setitem__(i, infer(client, "auto", values[i])))
               for i in range(3)]  # fmt: skip
    for caller in callers:
        caller.start()
    for caller in callers + [held]:
        caller.join(60)
    for i, value in enumerate(values):
        np.testing.assert_array_equal(results[i], value * 2)
    runs_after, rows_after = _counts(daemon, "auto")
    assert (runs_after - runs_before, rows_after - rows_before) == (1, 3)


def _hold_the_worker(daemon: Daemon) -> threading.Thread:
    def call():
        client = triton.InferenceServerClient(daemon.address)
        tensor = triton.InferInput("iterations", [], "INT64")
        tensor.set_data_from_numpy(np.array(400_000, np.int64))
        client.infer("slow", [tensor], client_timeout=60)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    return thread


def _counts(daemon: Daemon, model: str) -> tuple[int, int]:
    """(runs, rows) of the model so far, as tritonclient's get_inference_statistics reads them."""
    stats = triton.InferenceServerClient(daemon.address).get_inference_statistics(model, as_json=True)
    entry = stats["model_stats"][0]
    return int(entry.get("execution_count", 0)), int(entry.get("inference_count", 0))


@pytest.mark.parametrize(("model", "runs"), [("batched", 1), ("unbatched", 4)])
def test_dynamic_batching_batches_that_model_alone(daemon, model, runs):
    runs_before, rows_before = _counts(daemon, model)
    held = _hold_the_worker(daemon)  # one run worker, busy: the four calls queue together
    values = [np.full((1, 3), i, np.float32) for i in range(4)]
    results: dict[int, np.ndarray] = {}

    def call(i):
        results[i] = infer(triton.InferenceServerClient(daemon.address), model, values[i])

    callers = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers + [held]:
        caller.join(60)
    for i, value in enumerate(values):  # each caller its own rows
        np.testing.assert_array_equal(results[i], value * 2)
    runs_after, rows_after = _counts(daemon, model)
    assert (runs_after - runs_before, rows_after - rows_before) == (runs, 4)


def test_a_config_that_does_not_match_the_savedmodel_fails_its_load_naming_both(tmp_path_factory, saved_sum):
    root = tmp_path_factory.mktemp("mismatch")
    add_model(root, "good", saved_sum)
    add_model(root, "wrong_type", saved_sum, 'input [ { name: "x" data_type: TYPE_INT32 dims: [ -1, 3 ] } ]')
    add_model(root, "wrong_name", saved_sum, 'output [ { name: "sum" data_type: TYPE_FP32 dims: [ -1 ] } ]')
    add_model(root, "wrong_dims", saved_sum, 'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]')
    add_model(root, "onnx", saved_sum, 'platform: "onnxruntime_onnx"')
    # Triton's default: a model that fails at start stops the start
    result = run_to_exit([f"--model-repository={root}"])
    assert result.returncode == 1 and "--exit-on-error is true" in result.stderr
    daemon = start(tmp_path_factory, f"--model-repository={root}", "--exit-on-error=false")
    try:
        client = triton.InferenceServerClient(daemon.address)
        assert client.is_model_ready("good")
        assert not client.is_server_ready()  # Triton's strict readiness: not every model serves
        for model, words in (
            ("wrong_type", ["input 'x' is TYPE_INT32, but the SavedModel's is TYPE_FP32"]),
            ("wrong_name", ["output 'sum' is not an output", "['doubled', 'total']"]),
            ("wrong_dims", ["input 'x' has dims [-1, 4]", "DT_FLOAT [-1,3] does not take"]),
        ):
            assert not client.is_model_ready(model)
            status = json.load(urllib.request.urlopen(f"{daemon.rest_url}/v1/models/{model}", timeout=10))
            message = status["model_version_status"][0]["status"]["error_message"]
            for word in words:
                assert word in message, message
        with pytest.raises(InferenceServerException, match="onnx"):
            client.get_model_metadata("onnx")
        assert "platform 'onnxruntime_onnx' cannot be served" in daemon.log()
    finally:
        daemon.stop()
    daemon = start(tmp_path_factory, f"--model-repository={root}", "--exit-on-error=false", "--strict-readiness=false")
    try:
        assert triton.InferenceServerClient(daemon.address).is_server_ready()
    finally:
        daemon.stop()


def test_poll_mode_follows_the_repository(tmp_path_factory, saved_sum, saved_any_width):
    root = tmp_path_factory.mktemp("polled")
    add_model(root, "first", saved_sum)
    daemon = start(tmp_path_factory, f"--model-repository={root}", "--model-control-mode=poll",
                   "--repository-poll-secs=0.3")  # fmt: skip
    try:
        client = triton.InferenceServerClient(daemon.address)
        value = np.ones((1, 3), np.float32)
        add_model(root, "second", saved_sum)  # a model added
        add_model(root, "first", saved_sum, version=2)  # a version added
        (root / "first" / "config.pbtxt").write_text("max_batch_size: 4 dynamic_batching {}")  # its config changed
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            config = client.get_model_config("first", as_json=True)["config"]
            if client.is_model_ready("second") and client.is_model_ready("first", "2") and config.get("max_batch_size"):
                break
            time.sleep(0.2)
        np.testing.assert_array_equal(infer(client, "second", value), value * 2)
        assert not client.is_model_ready("first", "1")  # latest 1: version 2 replaced it
        assert int(client.get_model_config("first", as_json=True)["config"]["max_batch_size"]) == 4
        shutil.rmtree(root / "second")  # a model removed
        deadline = time.monotonic() + 30
        while client.is_model_ready("second") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_model_ready("second")
        (root / "first" / "config.pbtxt").write_text("max_batch_sise: 4")  # a broken config: the model stays
        time.sleep(1.5)
        np.testing.assert_array_equal(infer(client, "first", value), value * 2)
        assert "max_batch_sise" in daemon.log()
        (root / "first" / "config.pbtxt").unlink()
        # version 2 replaced in place by a SavedModel taking any width: reloaded, as Triton's poll mode reloads it
        shutil.rmtree(root / "first" / "2" / "model.savedmodel")
        shutil.copytree(saved_any_width, root / "first" / "2" / "model.savedmodel")
        wide = np.ones((1, 5), np.float32)
        while time.monotonic() < deadline + 30:
            try:
                np.testing.assert_array_equal(infer(client, "first", wide), wide * 2)
                break
            except InferenceServerException:  # still the old SavedModel (x [None,3]), or reloading
                time.sleep(0.2)
        np.testing.assert_array_equal(infer(client, "first", wide), wide * 2)
    finally:
        daemon.stop()


def test_an_empty_repository_starts_and_serves_what_is_added_in_poll_mode(tmp_path_factory, saved_sum):
    root = tmp_path_factory.mktemp("empty")
    daemon = Daemon([f"--model-repository={root}", "--model-control-mode=poll", "--repository-poll-secs=0.3"],
                    tmp_path_factory.mktemp("servex"))  # fmt: skip
    try:
        client = triton.InferenceServerClient(daemon.address)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert daemon.proc.poll() is None, daemon.log()  # an empty repository is no reason to exit, as in Triton
            try:
                if client.is_server_live():
                    break
            except InferenceServerException:
                pass
            time.sleep(0.2)
        assert client.is_server_ready()  # every model (none) serves
        add_model(root, "late", saved_sum)
        while not client.is_model_ready("late") and time.monotonic() < deadline:
            time.sleep(0.2)
        value = np.ones((1, 3), np.float32)
        np.testing.assert_array_equal(infer(client, "late", value), value * 2)
    finally:
        daemon.stop()


def test_explicit_mode_loads_what_it_is_told_on_every_port(tmp_path_factory, saved_sum):
    root = tmp_path_factory.mktemp("explicit")
    for name in ("a", "b", "c"):
        add_model(root, name, saved_sum)
    admin = free_port()
    daemon = start(tmp_path_factory, f"--model-repository={root}", "--model-control-mode=explicit",
                   "--load-model=a", f"--admin_port={admin}")  # fmt: skip
    try:
        client = triton.InferenceServerClient(daemon.address)  # the extension on the main port, as in Triton
        http_client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}")
        admin_client = triton.InferenceServerClient(f"127.0.0.1:{admin}")  # and on the admin port, the same one
        assert client.is_model_ready("a") and not client.is_model_ready("b")
        assert client.is_server_ready()
        assert "model_repository" in client.get_server_metadata(as_json=True)["extensions"]
        assert "model_repository" in http_client.get_server_metadata()["extensions"]
        index = {m["name"]: m.get("state", "") for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index == {"a": "READY", "b": "", "c": ""}  # b and c are in the repository, never loaded
        assert {m["name"]: m.get("state", "") for m in http_client.get_model_repository_index()} == index
        (root / "b" / "config.pbtxt").write_text("max_batch_size: 2 dynamic_batching {}")  # read at the load
        client.load_model("b")
        assert client.is_model_ready("b")
        assert int(client.get_model_config("b", as_json=True)["config"]["max_batch_size"]) == 2
        http_client.load_model("c")
        assert client.is_model_ready("c")
        http_client.unload_model("c")
        assert not client.is_model_ready("c")
        admin_client.unload_model("a")
        assert not client.is_model_ready("a")
        index = {m["name"]: m.get("state", "") for m in admin_client.get_model_repository_index(as_json=True)["models"]}
        assert index["a"] == "UNAVAILABLE" and index["b"] == "READY"
        (root / "a" / "config.pbtxt").write_text('platform: "pytorch_libtorch"')
        with pytest.raises(InferenceServerException, match="platform 'pytorch_libtorch' cannot be served"):
            client.load_model("a")
        with pytest.raises(InferenceServerException, match="no model 'no_such_model' in any model repository"):
            http_client.load_model("no_such_model")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
        request = service_pb2.RepositoryModelLoadRequest(model_name="b")
        request.parameters["base_path"].string_param = str(root / "b")  # servex's own parameter: not with repositories
        with pytest.raises(grpc.RpcError) as e:
            stub.RepositoryModelLoad(request, timeout=30)
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "supported: none (models load by name" in e.value.details()
        )
    finally:
        daemon.stop()
    result = run_to_exit([f"--model-repository={root}", "--model-control-mode=explicit", "--load-model=d"])
    assert result.returncode == 1 and "--load-model d: no such model in the model repositories" in result.stderr


def test_a_restricted_repository_extension_asks_for_its_header(tmp_path_factory, saved_sum):
    root = tmp_path_factory.mktemp("restricted")
    for name in ("a", "b"):
        add_model(root, name, saved_sum)
    daemon = start(tmp_path_factory, f"--model-repository={root}", "--model-control-mode=explicit",
                   "--grpc-restricted-protocol=model-repository:admin-key=s3cret",
                   "--http-restricted-api=model-repository:admin-key=s3cret",
                   "--load-model=a", "--rest_api_timeout_in_ms=1")  # fmt: skip
    try:
        client = triton.InferenceServerClient(daemon.address)
        http_client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}")
        with pytest.raises(InferenceServerException, match="PERMISSION_DENIED.*expects header 'admin-key'"):
            client.unload_model("a")
        with pytest.raises(InferenceServerException, match="expects header 'admin-key'") as e:
            http_client.load_model("b", headers={"admin-key": "wrong"})
        assert e.value.status() == "403"
        assert client.is_model_ready("a") and not client.is_model_ready("b")
        # a load takes far longer than the 1 ms REST deadline: it is not bounded by it, it answers when b serves
        http_client.load_model("b", headers={"admin-key": "s3cret"})
        assert client.is_model_ready("b")
        client.unload_model("a", headers={"admin-key": "s3cret"})
        assert not client.is_model_ready("a")
    finally:
        daemon.stop()


def test_in_none_mode_the_repository_extension_refuses_to_load_and_unload(tmp_path_factory, saved_sum):
    root = tmp_path_factory.mktemp("none")
    add_model(root, "a", saved_sum)
    admin = free_port()
    daemon = start(tmp_path_factory, f"--model-repository={root}", f"--admin_port={admin}")
    try:
        repository = triton.InferenceServerClient(f"127.0.0.1:{admin}")
        for call in (repository.load_model, repository.unload_model):
            with pytest.raises(InferenceServerException, match="needs --model-control-mode=explicit"):
                call("a")
        assert triton.InferenceServerClient(daemon.address).is_model_ready("a")
    finally:
        daemon.stop()
