"""`servex-health` (server/healthcheck.py), the image's HEALTHCHECK: run as the installed console script against a
real servex daemon (SERVING: exit 0), an unknown service, a closed port, a port that never answers (the timeout
holds) and a real gRPC health server reporting NOT_SERVING (exit 1); and it never imports TensorFlow."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.daemon import free_port

SCRIPT = Path(sys.executable).parent / "servex-health"


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon()  # default flags: the bundled demo model, "demo" (a daemon other modules share)


def probe(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), f"{SCRIPT} is missing: reinstall with pip install -e . (console script servex-health)"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_serving_server_and_model_exit_0(daemon):
    result = probe(f"--address={daemon.address}")
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout
    result = probe(f"--address={daemon.address}", "--service=demo", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def test_unknown_service_exits_1_and_says_why(daemon):
    result = probe(f"--address={daemon.address}", "--service=no_such_model")
    assert result.returncode == 1
    assert "no_such_model" in result.stderr and "NOT_FOUND" in result.stderr


def test_closed_port_exits_1(daemon):
    result = probe(f"--address=127.0.0.1:{free_port()}", "--timeout=2")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_silent_port_exits_1_within_timeout():
    """A port that accepts connections and never speaks HTTP/2 (a hung server): the probe gives up on time."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        start = time.monotonic()
        result = probe(f"--address=127.0.0.1:{listener.getsockname()[1]}", "--timeout=1.5")
        elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "DEADLINE_EXCEEDED" in result.stderr or "UNAVAILABLE" in result.stderr
    assert elapsed < 1.5 + 5, elapsed


def test_not_serving_exits_1():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = probe(f"--address=127.0.0.1:{port}")
        assert result.returncode == 1
        assert "NOT_SERVING" in result.stderr
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe(f"--address=127.0.0.1:{port}").returncode == 0
    finally:
        server.stop(None)


def test_bad_timeout_is_a_usage_error():
    result = probe("--timeout=0")
    assert result.returncode == 2
    assert "--timeout must be positive" in result.stderr


def test_does_not_import_tensorflow():
    code = "import sys, server.healthcheck; assert 'tensorflow' not in sys.modules, 'tensorflow imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
