"""Model lifecycle as in TensorFlow Serving, through the real daemon and tensorflow-serving-api stubs: config files,
version policies and labels, new versions appearing under load, failed loads, reload by RPC."""

from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from tensorflow_serving.config import model_server_config_pb2

from tests.support.clients import predict, y
from tests.support.daemon import Daemon, metric, model_config_file, run_to_exit, wait_for
from tests.support.models import write_warmup_file
from tests.support.paths import BAD_HALF_PLUS_TWO, EXPECTED, HALF_PLUS_THREE, HALF_PLUS_TWO_TF1, TWO_VERSIONS

AVAILABLE = get_model_status_pb2.ModelVersionStatus.AVAILABLE
END = get_model_status_pb2.ModelVersionStatus.END


def status(channel, model, *, version=None, label=""):
    req = get_model_status_pb2.GetModelStatusRequest()
    req.model_spec.name = model
    if version is not None:
        req.model_spec.version.value = version
    if label:
        req.model_spec.version_label = label
    reply = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(req, timeout=10)
    return {s.version: (s.state, s.status.error_code, s.status.error_message) for s in reply.model_version_status}


POLICY_CONFIG = f"""
model_config_list {{
  config {{ name: "latest1" base_path: "{TWO_VERSIONS}" model_platform: "tensorflow" }}
  config {{ name: "latest2" base_path: "{TWO_VERSIONS}"
           model_version_policy {{ latest {{ num_versions: 2 }} }} }}
  config {{ name: "all" base_path: "{TWO_VERSIONS}" model_version_policy {{ all {{}} }} }}
  config {{ name: "specific" base_path: "{TWO_VERSIONS}"
           model_version_policy {{ specific {{ versions: 123 }} }} }}
  config {{ name: "labelled" base_path: "{TWO_VERSIONS}" model_version_policy {{ all {{}} }}
           version_labels {{ key: "stable" value: 123 }} version_labels {{ key: "canary" value: 124 }} }}
}}
"""


@pytest.fixture(scope="module")
def policies(start_daemon, tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "models.config"
    config.write_text(POLICY_CONFIG)
    return start_daemon(f"--model_config_file={config}")


@pytest.mark.parametrize(
    "model, versions",
    [("latest1", [124]), ("latest2", [123, 124]), ("all", [123, 124]), ("specific", [123]), ("labelled", [123, 124])],
)
def test_version_policies(policies, model, versions):
    assert status(policies.channel, model) == {v: (AVAILABLE, 0, "") for v in versions}
    for v in versions:
        assert predict(policies.channel, model, [[1.0]], version=v).model_spec.version.value == v
    assert predict(policies.channel, model, [[1.0]]).model_spec.version.value == max(versions)
    for v in {123, 124} - set(versions):
        with pytest.raises(grpc.RpcError) as info:
            predict(policies.channel, model, [[1.0]], version=v)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and f"no version {v}" in info.value.details()


def test_a_reload_moving_a_label_to_a_version_not_available_changes_nothing(policies):
    """TensorFlow Serving refuses it whole (FAILED_PRECONDITION, its words): the label keeps its version and the
    models the new config drops stay."""
    from google.protobuf import text_format

    moved = POLICY_CONFIG.replace('key: "stable" value: 123', 'key: "stable" value: 125')
    config = text_format.Parse(moved, model_server_config_pb2.ModelServerConfig())
    kept = [c for c in config.model_config_list.config if c.name != "all"]
    del config.model_config_list.config[:]
    config.model_config_list.config.extend(kept)
    stub = model_service_pb2_grpc.ModelServiceStub(policies.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith(
        "Request to assign label to version 125 of model labelled, which is not currently available for inference"
    )
    assert predict(policies.channel, "labelled", [[1.0]], label="stable").model_spec.version.value == 123
    assert status(policies.channel, "all") == {123: (AVAILABLE, 0, ""), 124: (AVAILABLE, 0, "")}


def test_model_status_lists_the_highest_version_first_as_tensorflow_serving(policies):
    """TensorFlow Serving's ServableStateMonitor keeps versions in descending order: clients read the first as the
    newest."""
    req = get_model_status_pb2.GetModelStatusRequest()
    req.model_spec.name = "all"
    reply = model_service_pb2_grpc.ModelServiceStub(policies.channel).GetModelStatus(req, timeout=10)
    assert [s.version for s in reply.model_version_status] == [124, 123]
    assert all(s.HasField("status") and s.status.error_code == 0 for s in reply.model_version_status)


def test_model_status_of_a_model_with_no_version_yet_is_not_found_as_in_tensorflow_serving(start_daemon, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    config = model_config_file(tmp_path, {"one": TWO_VERSIONS, "empty": empty})
    daemon = start_daemon(f"--model_config_file={config}", rest=True)
    with pytest.raises(grpc.RpcError) as info:
        status(daemon.channel, "empty")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == (
        "Could not find any versions of model empty: none has been found under its base path yet"
    )
    try:
        urllib.request.urlopen(f"{daemon.rest_url}/v1/models/empty", timeout=10)
        raise AssertionError("REST answered a model with no version")
    except urllib.error.HTTPError as e:
        assert e.code == 404 and b"Could not find any versions of model empty" in e.read()
    assert status(daemon.channel, "one") == {124: (AVAILABLE, 0, "")}  # the other model is served


def test_version_labels_in_predict_metadata_and_status(policies):
    assert predict(policies.channel, "labelled", [[1.0]], label="stable").model_spec.version.value == 123
    assert predict(policies.channel, "labelled", [[1.0]], label="canary").model_spec.version.value == 124
    req = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    req.model_spec.name = "labelled"
    req.model_spec.version_label = "stable"
    reply = prediction_service_pb2_grpc.PredictionServiceStub(policies.channel).GetModelMetadata(req, timeout=10)
    assert reply.model_spec.version.value == 123
    assert status(policies.channel, "labelled", label="canary") == {124: (AVAILABLE, 0, "")}
    assert status(policies.channel, "labelled", version=123) == {123: (AVAILABLE, 0, "")}
    with pytest.raises(grpc.RpcError) as info:
        predict(policies.channel, "labelled", [[1.0]], label="beta")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # as TensorFlow Serving's unrecognized label
    assert "'beta'" in info.value.details() and "stable=123" in info.value.details()
    assert info.value.details().startswith("Unrecognized servable version label: beta; ")  # TensorFlow Serving's
    with pytest.raises(grpc.RpcError) as info:
        status(policies.channel, "labelled", label="beta")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("Unrecognized servable version label: beta; ")


def test_good_model_config_from_tensorflow_serving_is_served(tmp_path):
    env = {"TEST_HALF_PLUS_TWO_DIR": str(HALF_PLUS_TWO_TF1), "TEST_HALF_PLUS_THREE_DIR": str(HALF_PLUS_THREE)}
    os.environ.update(env)
    try:
        daemon = Daemon([f"--model_config_file={EXPECTED / 'good_model_config.txt'}"], tmp_path).wait_serving()
    finally:
        for key in env:
            os.environ.pop(key)
    try:
        assert y(predict(daemon.channel, "half_plus_two", [[2.0]])) == [3.0]
        assert y(predict(daemon.channel, "half_plus_three", [[2.0]])) == [4.0]
    finally:
        daemon.stop()


def test_bad_model_config_is_refused_with_a_clear_error():
    out = run_to_exit([f"--model_config_file={EXPECTED / 'bad_model_config.txt'}"])
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "bad_model_config.txt" in text and "text format" in text and "nothing to serve" in text


def _copy_version(src: Path, dst: Path) -> None:
    """Copy a version folder the way an operator would: it appears, then fills."""
    shutil.copytree(src, dst)


def test_new_version_appears_under_load_without_a_failed_request(start_daemon, tmp_path):
    base = tmp_path / "model"
    _copy_version(HALF_PLUS_TWO_TF1 / "00000123", base / "1")
    daemon = start_daemon(f"--model_base_path={base}", "--model_name=m", "--file_system_poll_wait_seconds=0.2")
    failures, answers, stop = [], [], threading.Event()

    def client():
        channel = grpc.insecure_channel(daemon.address)
        while not stop.is_set():
            try:
                reply = predict(channel, "m", [[2.0]])
                answers.append((reply.model_spec.version.value, y(reply)[0]))
            except grpc.RpcError as e:
                failures.append(f"{e.code()}: {e.details()}")
        channel.close()

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(answers) > 20, what="traffic on version 1")
        _copy_version(HALF_PLUS_THREE / "00000123", base / "2")
        wait_for(lambda: answers and answers[-1][0] == 2, timeout=30, what="version 2 to answer")
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert failures == []
    assert (1, 3.0) in answers and answers[-1] == (2, 4.0)  # half_plus_two, then half_plus_three
    # version 1 unloads and stays in the status as END, with an OK status, as in TensorFlow Serving
    wait_for(lambda: status(daemon.channel, "m") == {1: (END, 0, ""), 2: (AVAILABLE, 0, "")}, what="v1 to unload")


@pytest.mark.parametrize("broken", ["bad_half_plus_two", "truncated_variables"])
def test_a_broken_new_version_is_reported_and_the_served_one_keeps_serving(start_daemon, tmp_path, broken):
    base = tmp_path / "model"
    _copy_version(HALF_PLUS_TWO_TF1 / "00000123", base / "1")
    daemon = start_daemon(
        f"--model_base_path={base}", "--model_name=m", "--file_system_poll_wait_seconds=0.2",
        "--max_num_load_retries=1", "--load_retry_interval_micros=100000",
    )  # fmt: skip
    staging = tmp_path / "staging"
    if broken == "bad_half_plus_two":
        _copy_version(BAD_HALF_PLUS_TWO / "00000123", staging)
    else:
        _copy_version(HALF_PLUS_TWO_TF1 / "00000123", staging)
        data = next((staging / "variables").glob("variables.data-*"))
        data.write_bytes(data.read_bytes()[:3])
    staging.rename(base / "2")
    states = wait_for(lambda: (s := status(daemon.channel, "m")).get(2, (0,))[0] == END and s, what="v2 to fail")
    state, code, message = states[2]
    assert code != 0 and message, states
    assert str(base / "2") in message
    if broken == "bad_half_plus_two":
        assert "saved_model.pb" in message
    assert states[1] == (AVAILABLE, 0, "")
    assert y(predict(daemon.channel, "m", [[2.0]])) == [3.0]
    with pytest.raises(grpc.RpcError) as info:
        predict(daemon.channel, "m", [[2.0]], version=2)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "failed to load" in info.value.details()
    assert "failed to load" in daemon.log() and "'m' version 2" in daemon.log()
    # one load and one retry failed (--max_num_load_retries=1); version 1's load was timed
    wait_for(lambda: metric(daemon, "servex_model_load_failures_total", model="m") == 2, what="the retry to fail")
    assert metric(daemon, "servex_model_load_seconds_count", model="m") == 1


def _reload(channel, models: dict[str, Path], timeout=60):
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.SetInParent()  # set even when empty
    for name, path in models.items():
        config.model_config_list.config.add(name=name, base_path=str(path), model_platform="tensorflow")
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    return stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=timeout)


def test_reload_config_replaces_the_models(start_daemon, tmp_path):
    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=two")
    reply = _reload(daemon.channel, {"three": HALF_PLUS_THREE, "two_again": HALF_PLUS_TWO_TF1})
    assert reply.status.error_code == 0
    assert y(predict(daemon.channel, "three", [[2.0]])) == [4.0]  # in effect when the reply came
    assert y(predict(daemon.channel, "two_again", [[2.0]])) == [3.0]
    with pytest.raises(grpc.RpcError) as info:
        predict(daemon.channel, "two", [[2.0]])
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'two'" in info.value.details()

    # A config naming a model that cannot load: the reply says so, the rest is in effect.
    with pytest.raises(grpc.RpcError) as info:
        _reload(daemon.channel, {"three": HALF_PLUS_THREE, "broken": BAD_HALF_PLUS_TWO})
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'broken'" in info.value.details() and "saved_model.pb" in info.value.details()
    assert y(predict(daemon.channel, "three", [[2.0]])) == [4.0]

    # An invalid config is refused whole.
    with pytest.raises(grpc.RpcError) as info:
        _reload(daemon.channel, {"": HALF_PLUS_THREE})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "name is empty" in info.value.details()
    assert y(predict(daemon.channel, "three", [[2.0]])) == [4.0]

    # A request that sets no config changes nothing (TensorFlow Serving: INVALID_ARGUMENT); an empty
    # model_config_list unloads every model.
    stub = model_service_pb2_grpc.ModelServiceStub(daemon.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sets no model_config_list" in info.value.details() and "model_config_list {}" in info.value.details()
    assert y(predict(daemon.channel, "three", [[2.0]])) == [4.0]
    assert _reload(daemon.channel, {}).status.error_code == 0
    assert not _serves(daemon, "three") and not _serves(daemon, "broken")


def test_concurrent_reloads_are_serialized(start_daemon):
    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=two")
    results, errors = [], []

    def reload(models):
        channel = grpc.insecure_channel(daemon.address)
        try:
            results.append(_reload(channel, models).status.error_code)
        except grpc.RpcError as e:
            errors.append(e)
        finally:
            channel.close()

    configs = [{"a": HALF_PLUS_TWO_TF1}, {"b": HALF_PLUS_THREE}, {"a": HALF_PLUS_TWO_TF1, "b": HALF_PLUS_THREE}]
    threads = [threading.Thread(target=reload, args=(c,)) for c in configs for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a reload never answered"
    assert errors == [] and results == [0] * 6
    served = {name for name in ("a", "b", "two") if _serves(daemon, name)}
    assert served in ({"a"}, {"b"}, {"a", "b"})  # exactly one config is in effect, whole


def _serves(daemon, name) -> bool:
    try:
        predict(daemon.channel, name, [[1.0]])
        return True
    except grpc.RpcError as e:
        # NOT_FOUND: not configured; UNAVAILABLE: configured, its first version still loading
        assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), e.details()
        return False


def test_config_file_is_re_read(start_daemon, tmp_path):
    config = tmp_path / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "two" base_path: "{HALF_PLUS_TWO_TF1}" }} }}')
    daemon = start_daemon(f"--model_config_file={config}", "--model_config_file_poll_wait_seconds=0.2")
    config.write_text(f'model_config_list {{ config {{ name: "three" base_path: "{HALF_PLUS_THREE}" }} }}')
    wait_for(lambda: _serves(daemon, "three"), what="the new config")
    assert not _serves(daemon, "two")
    config.write_text("this is not a config")  # a broken edit leaves the models as they are
    time.sleep(1)
    assert _serves(daemon, "three")
    assert "not applied" in daemon.log()
    config.write_text("")  # so does a file caught empty (truncated, about to be written)
    wait_for(lambda: "sets no model_config_list" in daemon.log(), what="the empty file to be refused")
    assert _serves(daemon, "three")
    config.write_text("model_config_list {}")  # an empty list unloads every model
    wait_for(lambda: not _serves(daemon, "three"), what="the empty list")


def test_the_server_is_ready_only_once_the_start_up_models_are_in(tmp_path, slow_model):
    """KServe v2 ServerReady and /v2/health/ready say what gRPC health says: not ready while a model of the start-up
    config still loads (here: warms up for seconds), though another one already serves and is ready itself."""
    import tritonclient.grpc as triton
    from tensorflow_serving.apis import prediction_log_pb2

    slow = tmp_path / "slow"
    shutil.copytree(slow_model, slow)
    record = prediction_log_pb2.PredictionLog()
    record.predict_log.request.CopyFrom(predict_pb2.PredictRequest())
    record.predict_log.request.inputs["iterations"].CopyFrom(tf.make_tensor_proto(np.array(3_000_000, np.int64)))
    write_warmup_file(slow / "1", [record.SerializeToString()])
    config = model_config_file(tmp_path, {"fast": HALF_PLUS_TWO_TF1, "slow": slow})
    daemon = Daemon([f"--model_config_file={config}", "--xla=false"], tmp_path, rest=True, spare=True)
    client = triton.InferenceServerClient(daemon.address)

    def rest_ok(path: str) -> bool:
        try:
            with urllib.request.urlopen(daemon.rest_url + path, timeout=20) as reply:
                return reply.status == 200
        except OSError:  # not listening yet, refused (4xx), or slow: not ready
            return False

    try:
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline and not rest_ok("/v2/health/ready"):
            if rest_ok("/v2/models/fast/ready") and not rest_ok("/v2/models/slow/ready"):
                ready = client.is_server_ready()
                if not rest_ok("/v2/models/slow/ready"):  # still warming up once answered: the answer was about it
                    seen.append(ready)
            time.sleep(0.05)
        assert seen and not any(seen), f"fast never seen serving alone while slow warmed up, or ready said: {seen}"
        daemon.wait_serving()
        assert client.is_server_ready() and rest_ok("/v2/health/ready")
        assert rest_ok("/v2/models/slow/ready")
    finally:
        client.close()
        daemon.stop()
