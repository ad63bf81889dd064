"""--grpc_socket_path (TensorFlow Serving's flag): gRPC on a UNIX domain socket beside the TCP port, every service
on it, through the real daemon; a socket another server holds, or a path that is no socket, stops servex at start
naming it (gRPC alone would unlink the other server's socket and take its clients); a stale socket is replaced;
the socket is removed when servex stops."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc

from tests.support.clients import predict_y
from tests.support.daemon import Daemon, run_to_exit
from tests.support.paths import HALF_PLUS_TWO_TF2

MODEL = "half"


@pytest.fixture(scope="module")
def served(start_daemon, tmp_path_factory):
    path = tmp_path_factory.mktemp("socket") / "grpc.sock"
    daemon = start_daemon(
        f"--model_base_path={HALF_PLUS_TWO_TF2}", f"--model_name={MODEL}", f"--grpc_socket_path={path}"
    )
    return daemon, path


def test_every_service_is_served_on_the_socket_and_on_the_port(served):
    daemon, path = served
    with grpc.insecure_channel(f"unix:{path}") as channel:
        assert predict_y(channel, MODEL, [1.0, 4.0]) == [2.5, 4.0]
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = MODEL
        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(request, timeout=10)
        assert status.model_version_status[0].state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert predict_y(daemon.channel, MODEL, [0.0]) == [2.0]
    assert f"gRPC on 127.0.0.1:{daemon.port} and unix:{path} (" in daemon.log()


def test_a_socket_another_server_holds_stops_servex_at_start(served):
    daemon, path = served
    result = run_to_exit([f"--grpc_socket_path={path}"])
    assert result.returncode == 1
    assert f"cannot bind gRPC to unix:{path}: [Errno 98] another process serves the socket {path}" in result.stderr
    with grpc.insecure_channel(f"unix:{path}") as channel:
        assert predict_y(channel, MODEL, [2.0]) == [3.0]  # still the first server's


def test_a_path_that_is_not_a_socket_is_left_alone(tmp_path):
    path = tmp_path / "models.config"
    path.write_text("precious")
    result = run_to_exit([f"--grpc_socket_path={path}"])
    assert result.returncode == 1
    assert f"cannot bind gRPC to unix:{path}: [Errno 17] {path} exists and is not a socket" in result.stderr
    assert path.read_text() == "precious"


def test_a_stale_socket_is_replaced_and_the_socket_is_removed_at_stop(tmp_path):
    path = tmp_path / "grpc.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # bound, never served, closed: as a killed server leaves it
        stale.bind(str(path))
    assert path.exists()
    daemon = Daemon([f"--grpc_socket_path={path}"], tmp_path, spare=True).wait_serving()
    try:
        with grpc.insecure_channel(f"unix:{path}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert daemon.stop() == 0
    assert not path.exists()
