"""--serving_processes: several serving processes share servex's ports, /metrics adds them up, SIGTERM drains
them all, one that dies before the group served stops it, and what would reach one process only is refused (one
that dies later is replaced: test_process_restart.py)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from tensorflow_serving.apis import (
    model_management_pb2,
    model_service_pb2_grpc,
)

from servex.server.affinity import group_index
from servex.server.config.settings import ServerSettings
from tests.support.clients import predict_y
from tests.support.daemon import Daemon, free_port, listening_sockets, metric, run_to_exit
from tests.support.paths import HALF_PLUS_TWO_TF1
from tests.support.processes import children as _children
from tests.support.processes import describe as _describe
from tests.support.processes import established_on as _established_on

CONNECTIONS = 16
ALLOWED = sorted(os.sched_getaffinity(0))
FIRST_INDEX = len(ALLOWED) - 1  # the last allowed CPU: the second process wraps around to the first


def _wait_both_ready(daemon: Daemon, timeout: float = 120) -> None:
    """Until both serving processes have logged 'servex ready' (the group's health turns SERVING with the first)."""
    deadline = time.monotonic() + timeout
    while daemon.log().count("servex ready") < 2:
        assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.log()
        time.sleep(0.1)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    folder = tmp_path_factory.mktemp("group")
    daemon = Daemon(
        [
            f"--model_base_path={HALF_PLUS_TWO_TF1}",
            "--model_name=half",
            "--serving_processes=2",
            f"--event_loop_cpu={FIRST_INDEX}",
            f"--grpc_socket_path={folder / 'grpc.sock'}",
        ],
        folder,
    )
    daemon.socket_path = folder / "grpc.sock"
    yield daemon.wait_serving()
    daemon.stop()


def test_both_processes_serve_the_port_and_metrics_add_up(group):
    children = _children(group.proc.pid)
    assert len(children) == 2
    _wait_both_ready(group)
    channels = [
        grpc.insecure_channel(group.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CONNECTIONS)
    ]  # one TCP connection each
    try:
        for i, channel in enumerate(channels):
            assert predict_y(channel, "half", [[i], [2 * i]]) == [0.5 * i + 2, i + 2]
        per_process = [_established_on(pid, group.port) for pid in children]
        assert sum(per_process) >= CONNECTIONS and all(n > 0 for n in per_process), per_process
    finally:
        for channel in channels:
            channel.close()
    assert metric(group, "servex_requests_total", method="Predict", model="half", code="OK") == CONNECTIONS


def test_the_first_process_serves_the_unix_socket(group):
    with grpc.insecure_channel(f"unix:{group.socket_path}") as channel:
        assert predict_y(channel, "half", [[4.0]]) == [4.0]
    _wait_both_ready(group)
    bound = [line for line in group.log().splitlines() if "gRPC on " in line]
    assert len(bound) == 2 and sum(f"and unix:{group.socket_path}" in line for line in bound) == 1, bound


def test_a_unix_socket_another_server_serves_fails_the_group_at_start(start_daemon, tmp_path):
    path = tmp_path / "taken.sock"
    start_daemon(f"--grpc_socket_path={path}")
    result = run_to_exit(
        [f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half", "--serving_processes=2",
         f"--grpc_socket_path={path}"],
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot run the serving processes: [Errno 98] another process serves the socket {path}" in result.stderr
    assert "supervising" not in result.stderr
    with grpc.insecure_channel(f"unix:{path}") as channel:  # the first server still has it
        grpc.channel_ready_future(channel).result(timeout=10)


def test_each_process_pins_its_event_loop_to_the_next_cpu(group):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and group.log().count("event loop pinned") < 2:
        time.sleep(0.2)  # each pins once its models are in
    loops = [os.sched_getaffinity(pid) for pid in _children(group.proc.pid)]  # each main thread: its loop's
    assert all(len(cpus) == 1 for cpus in loops), loops
    pinned = sorted(cpu for cpus in loops for cpu in cpus)
    assert ALLOWED[-1] in pinned and len(set(pinned)) == min(2, len(ALLOWED)), group.log()
    assert pinned == sorted(ALLOWED[group_index(FIRST_INDEX, process)] for process in (0, 1))


def test_reload_by_rpc_is_refused_in_a_group(group):
    stub = model_service_pb2_grpc.ModelServiceStub(group.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "one of 2 serving processes" in info.value.details() and "--model_config_file" in info.value.details()
    assert predict_y(group.channel, "half", [[4.0]]) == [4.0]


def test_the_admin_api_needs_a_single_process():
    result = run_to_exit(["--serving_processes=2", "--admin_port=0", "--admin_token_file=/dev/null"])
    assert result.returncode == 2
    assert "needs --serving_processes=1" in result.stderr


def test_sigterm_drains_every_process(tmp_path):
    daemon = Daemon([f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half", "--serving_processes=2"], tmp_path)
    daemon.wait_serving()  # one process serves: the other may still be starting, and would stop without serving
    _wait_both_ready(daemon)
    children = _children(daemon.proc.pid)
    assert predict_y(daemon.channel, "half", [[2.0]]) == [3.0]
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit(60) == 0
    left = {pid: _describe(pid) for pid in children if Path(f"/proc/{pid}").exists()}
    assert not left, left  # (once seen failing in a full run, not since: the description says what was left)
    assert daemon.log().count("servex stopped") == 2
    daemon.stop()


def test_sigterm_while_the_processes_start_exits_zero(tmp_path):
    # A serving process the SIGTERM reaches before it serves stops as asked (the supervisor used to exit 241, the
    # status of a process its default action had killed).
    daemon = Daemon([f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half", "--serving_processes=2"], tmp_path)
    deadline = time.monotonic() + 60
    while len(_children(daemon.proc.pid)) < 2:
        assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.log()
        time.sleep(0.01)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit(60) == 0, daemon.log()
    assert "serving processes exited with [0, 0]" in daemon.log()
    daemon.stop()


def test_a_process_that_dies_before_the_group_served_stops_the_group(tmp_path):
    daemon = Daemon([f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half", "--serving_processes=2"], tmp_path)
    deadline = time.monotonic() + 60
    while len(_children(daemon.proc.pid)) < 2:  # started, still importing TensorFlow: neither serves yet
        assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.log()
        time.sleep(0.01)
    children = _children(daemon.proc.pid)
    os.kill(children[0], signal.SIGKILL)
    assert daemon.wait_exit(60) == 1
    assert "was killed by SIGKILL before the group served: stopping the group" in daemon.log()
    assert not Path(f"/proc/{children[1]}").exists() or Path(f"/proc/{children[1]}/stat").read_text().split()[2] == "Z"
    daemon.stop()


def test_a_taken_metrics_port_fails_the_group_at_start_and_leaves_no_process():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_to_exit(
            [f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half", "--serving_processes=2",
             f"--metrics_port={port}"],
            timeout=120,
        )  # fmt: skip
    assert result.returncode == 1
    assert "cannot run the serving processes" in result.stderr and "Address already in use" in result.stderr
    assert "supervising" not in result.stderr  # no serving process was started


@pytest.mark.parametrize("flag", ["--port", "--rest_api_port"])
def test_a_port_another_server_listens_on_fails_the_group_at_start(shared_daemon, flag):
    other = shared_daemon()  # a servex alone on its ports (default flags): its listeners use SO_REUSEPORT too
    port = other.port if flag == "--port" else free_port()
    with socket.socket() as taken:
        if flag == "--rest_api_port":
            taken.bind(("127.0.0.1", port))
            taken.listen()
        result = run_to_exit(
            [f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half", "--serving_processes=2", f"{flag}={port}"],
            timeout=120,
        )
    assert result.returncode == 1
    assert "cannot run the serving processes" in result.stderr and "Address already in use" in result.stderr
    assert "supervising" not in result.stderr  # no serving process was started
    assert listening_sockets(other.port) == ServerSettings().grpc_listeners  # the first one's, untouched
