"""--enable_profiler (TensorFlow Serving's flag, on by default): the daemon serves tensorflow.ProfilerService on its
gRPC port, and TensorFlow's own client, tf.profiler.experimental.client.trace (what TensorBoard's "Capture profile"
calls), records it while it serves Predict, into the logdir where TensorBoard looks."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from servex.protos.tensorflow import profiler_service_pb2, profiler_service_pb2_grpc
from tests.support.clients import expect_error, predict_y
from tests.support.paths import HALF_PLUS_TWO_TF1

pytestmark = pytest.mark.integration

MODEL = "half"


def test_trace_records_the_daemons_runs_into_tensorboards_folder(start_daemon, tmp_path):
    daemon = start_daemon(f"--model_name={MODEL}", f"--model_base_path={HALF_PLUS_TWO_TF1}")
    stop, calls = threading.Event(), []

    def predicting():
        with grpc.insecure_channel(daemon.address) as channel:
            while not stop.is_set():
                calls.append(predict_y(channel, MODEL, np.ones((1, 1), np.float32)))

    thread = threading.Thread(target=predicting, daemon=True)
    thread.start()
    try:
        tf.profiler.experimental.client.trace(f"grpc://{daemon.address}", str(tmp_path), 2000)
    finally:
        stop.set()
        thread.join(60)
    assert calls and all(y == [2.5] for y in calls)
    (written,) = (tmp_path / "plugins" / "profile").glob("*/*.xplane.pb")  # <logdir>/plugins/profile/<run>/
    assert written.name == f"127.0.0.1_{daemon.port}.xplane.pb"
    space = xplane_pb2.XSpace.FromString(written.read_bytes())
    names = {
        plane.event_metadata[event.metadata_id].name
        for plane in space.planes
        for line in plane.lines
        for event in line.events
    }
    assert "x:0^y:0^" in names, sorted(names)[:50]  # servex's runs, by their client graph


def test_with_the_profiler_off_the_service_is_not_served(start_daemon, tmp_path):
    daemon = start_daemon("--enable_profiler=false", f"--model_name={MODEL}", f"--model_base_path={HALF_PLUS_TWO_TF1}")
    stub = profiler_service_pb2_grpc.ProfilerServiceStub(daemon.channel)
    request = profiler_service_pb2.ProfileRequest(duration_ms=100, repository_root=str(tmp_path), session_id="s")
    expect_error(grpc.StatusCode.UNIMPLEMENTED, [], stub.Profile, request, timeout=30)
    assert not list(tmp_path.iterdir())
    assert predict_y(daemon.channel, MODEL, np.ones((1, 1), np.float32)) == [2.5]  # serving as ever
