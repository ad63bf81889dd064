"""The servex process: CLI, the bundled demo model, version selection, start-up failures, limits, drain."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from servex.server.cli import build_parser
from tests.support.clients import predict
from tests.support.daemon import Daemon, listening_sockets, run_to_exit
from tests.support.paths import BAD_HALF_PLUS_TWO, HALF_PLUS_TWO_TF1, TESTDATA


def test_help_documents_every_flag():
    script = Path(sys.executable).parent / "servex"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    flags = [
        opt
        for action in build_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--") and action.help != argparse.SUPPRESS  # internal: set by the supervisor
    ]
    for flag in ["--port", "--model_name", "--model_base_path", "--rest_api_port", "--metrics_port"]:
        assert flag in flags
    for flag in flags:
        assert flag in out.stdout, f"{flag} missing from --help"
    assert all(action.help for action in build_parser()._actions), "a flag has no help text"
    assert "(default: 8500)" in out.stdout and "(default: 8501)" in out.stdout and "(default: 8502)" in out.stdout


def test_no_model_flags_serve_the_bundled_demo_model(shared_daemon):
    daemon = shared_daemon()  # no flags: shared with the other tests that ask for a servex of default flags
    reply = predict(daemon.channel, "demo", {"x": np.array([1.0, 2.0, 5.0], np.float32)})
    assert tf.make_ndarray(reply.outputs["y"]).tolist() == [2.5, 3.0, 4.5]
    assert reply.model_spec.version.value == 1
    frozen = re.search(r"froze (\d+) start-up objects", daemon.log())
    assert frozen and int(frozen.group(1)) > 10_000, daemon.log()  # TensorFlow's and the model's, out of GC scans


def test_highest_numbered_version_loads(start_daemon, tmp_path):
    # 9 sorts after 10 as text; servex compares numbers, as TensorFlow Serving does.
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", tmp_path / "9")
    shutil.copytree(TESTDATA / "saved_model_half_plus_three" / "00000123", tmp_path / "10")
    (tmp_path / "not_a_version").mkdir()
    daemon = start_daemon(f"--model_base_path={tmp_path}", "--model_name=hp")
    reply = predict(daemon.channel, "hp", {"x": np.array([[1.0], [2.0]], np.float32)})
    assert reply.model_spec.version.value == 10
    assert tf.make_ndarray(reply.outputs["y"]).ravel().tolist() == [3.5, 4.0]  # half_plus_three


@pytest.mark.parametrize(
    "make_base, fragments",
    [
        (lambda tmp: BAD_HALF_PLUS_TWO, [str(BAD_HALF_PLUS_TWO / "00000123"), "saved_model.pb", "export.meta"]),
        (lambda tmp: tmp / "missing", ["missing", "does not exist"]),
        (lambda tmp: tmp, ["holds no version folder"]),
        (lambda tmp: _corrupt_model(tmp), ["corrupt", "1", "cannot load SavedModel"]),
        (lambda tmp: _truncated_variables(tmp), ["truncated", "variables.data-00000-of-00001"]),
    ],
    ids=["bad_half_plus_two", "missing-path", "no-versions", "corrupt-pb", "truncated-variables"],
)
def test_a_model_that_does_not_load_stops_the_process_with_a_clear_error(tmp_path, make_base, fragments):
    base = make_base(tmp_path)
    out = run_to_exit([f"--model_base_path={base}"])
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "nothing to serve" in text
    for fragment in fragments:
        assert fragment in text


def _corrupt_model(tmp: Path) -> Path:
    version = tmp / "corrupt" / "1"
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", version)
    (version / "saved_model.pb").write_bytes(b"\x0a\xff\xff\xff this is not a protobuf")
    return version.parent


def _truncated_variables(tmp: Path) -> Path:
    version = tmp / "truncated" / "1"
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", version)
    data = next((version / "variables").glob("variables.data-*"))
    data.write_bytes(data.read_bytes()[:3])
    return version.parent


def test_grpc_listeners_share_the_port_and_a_second_servex_on_it_is_refused(start_daemon):
    daemon = start_daemon("--grpc_listeners=3")
    assert listening_sockets(daemon.port) == 3
    assert "(3 listeners)" in daemon.log()
    # SO_REUSEPORT would let a second servex in to take half the connections: it must fail its start instead
    out = run_to_exit([f"--port={daemon.port}", f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half"])
    assert out.returncode == 1
    assert f"cannot bind gRPC to 127.0.0.1:{daemon.port}" in out.stderr and "in use" in out.stderr
    assert listening_sockets(daemon.port) == 3
    reply = predict(daemon.channel, "demo", {"x": np.array([1.0], np.float32)})
    assert tf.make_ndarray(reply.outputs["y"]).tolist() == [2.5]


@pytest.mark.parametrize(
    ("flag", "port_name"),
    [("--rest_api_port", "REST"), ("--metrics_port", "metrics"), ("--admin_port", "the admin port")],
)
def test_a_busy_port_exits_1_with_a_clear_error(flag, port_name):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_to_exit([f"{flag}={port}", f"--model_base_path={HALF_PLUS_TWO_TF1}"])
    assert out.returncode == 1, out.stderr
    assert f"cannot bind {port_name} to 127.0.0.1:{port}" in out.stderr and "in use" in out.stderr
    assert f"({flag})" in out.stderr  # the flag to change is named
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr


def test_message_size_limit_gives_resource_exhausted_and_keeps_serving(start_daemon):
    daemon = start_daemon("--max_message_bytes=4096")
    with pytest.raises(grpc.RpcError) as info:
        predict(daemon.channel, "demo", {"x": np.ones(4000, np.float32)})
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4096" in info.value.details() or "larger than max" in info.value.details()
    assert (
        tf.make_ndarray(predict(daemon.channel, "demo", {"x": np.ones(8, np.float32)}).outputs["y"]).tolist()
        == [2.5] * 8
    )


def test_sigterm_finishes_in_flight_calls_refuses_new_ones_and_exits_zero(slow_model, tmp_path):
    args = [f"--model_base_path={slow_model}", "--model_name=slow", "--xla=false"]
    daemon = Daemon(args, tmp_path, spare=True).wait_serving()
    iterations = 400_000  # about a second on this machine
    outcome = {}

    def call():
        channel = grpc.insecure_channel(daemon.address)
        try:
            reply = predict(channel, "slow", {"iterations": np.array(iterations, np.int64)}, timeout=60)
            outcome["count"] = int(tf.make_ndarray(reply.outputs["count"]))
        except grpc.RpcError as e:
            outcome["error"] = e
        finally:
            channel.close()

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.3)  # the call is running
    daemon.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    health = health_pb2_grpc.HealthStub(daemon.channel)
    with pytest.raises(grpc.RpcError) as refused:  # no new calls while draining
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    caller.join(60)
    assert outcome.get("count") == iterations, outcome
    assert daemon.wait_exit(60) == 0
    assert "draining" in daemon.log() and "servex stopped" in daemon.log()
    daemon.stop()


def test_sigterm_while_tensorflow_imports_exits_zero(tmp_path):
    # Before the server takes SIGTERM over, the signal's default action killed the process (-15), and a process
    # group's supervisor reported the group's stop as a failure (exit 241).
    daemon = Daemon([], tmp_path)
    deadline = time.monotonic() + 60
    while "tensorflow" not in Path(f"/proc/{daemon.proc.pid}/maps").read_text():  # importing TensorFlow
        assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.log()
        time.sleep(0.01)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit(60) == 0, daemon.log()
    assert "SIGTERM before serving: stopped" in daemon.log()
    daemon.stop()


def test_broadcast_beyond_the_message_limit_is_refused_and_serving_goes_on(start_daemon):
    daemon = start_daemon("--max_message_bytes=1048576")
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "demo"
    x = req.inputs["x"]
    x.dtype = tf.float32.as_datatype_enum
    x.tensor_shape.dim.add(size=1 << 30)  # one value, broadcast over 4 GiB
    x.float_val.append(1.0)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'x'" in info.value.details() and "1048576" in info.value.details()
    assert tf.make_ndarray(predict(daemon.channel, "demo", {"x": np.ones(2, np.float32)}).outputs["y"]).tolist() == [
        2.5,
        2.5,
    ]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning one CPU out of one changes nothing")
def test_event_loop_cpu_pins_the_loop_thread_only(start_daemon):
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)  # the last allowed CPU: index len - 1
    daemon = start_daemon(f"--event_loop_cpu={len(allowed) - 1}")
    reply = predict(daemon.channel, "demo", {"x": np.array([1.0, 2.0], np.float32)})
    assert tf.make_ndarray(reply.outputs["y"]).tolist() == [2.5, 3.0]
    pid = daemon.proc.pid
    assert os.sched_getaffinity(pid) == {cpu}, daemon.log()  # the main thread (its tid is the pid) runs the loop
    assert f"event loop pinned to CPU {cpu}" in daemon.log()
    deadline = time.monotonic() + 10  # threads started since are released within the watcher's second
    while True:
        others = {int(t.name): os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()}
        confined = [tid for tid, cpus in others.items() if tid != pid and cpus != allowed]
        if not confined or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(others) > 3 and not confined, others  # run workers, TensorFlow's and gRPC's threads: every CPU
