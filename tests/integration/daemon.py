"""Start the real servex daemon as a subprocess on free loopback ports, and wait until it serves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO

START_TIMEOUT_S = 120


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port that this test process has not handed out before: the kernel may offer a port again
    as soon as the probe's socket closes, and two flags of one daemon given the same port fail its start."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class Daemon:
    """A running `servex` process; ``args`` are its flags beyond the ports and bind address. With ``rest``, its
    REST API listens on a free port (``rest_port``, ``rest_url``); else REST is off. ``channel`` talks to its gRPC
    port, over TLS with ``credentials`` (gRPC channel credentials; the daemon's --ssl_config_file is in ``args``)."""

    def __init__(self, args: list[str], log_dir: Path, rest: bool = False, credentials=None):
        self.port = free_port()
        self.metrics_port = free_port()
        self.rest_port = free_port() if rest else 0
        self.rest_url = f"http://127.0.0.1:{self.rest_port}"
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"servex-{self.port}.log"
        self._log = open(self.log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            "servex.server",
            f"--port={self.port}",
            f"--metrics_port={self.metrics_port}",
            f"--rest_api_port={self.rest_port}",
            "--bind_address=127.0.0.1",
            *args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if credentials is None:
            self.channel = grpc.insecure_channel(self.address)
        else:
            self.channel = grpc.secure_channel(self.address, credentials)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> Daemon:
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"servex exited with {self.proc.returncode} before serving:\n{self.log()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"servex did not become SERVING within {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int:
        self.channel.close()
        terminate(self.proc)
        self._log.close()
        return self.proc.returncode


def terminate(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM ``proc`` if it still runs and wait for it; SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def listening_sockets(port: int) -> int:
    """How many sockets listen on ``port`` on this machine (the IPv4 and IPv6 tables of /proc/net)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)  # the header
            for line in f:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    count += 1
    return count


def run_to_exit(args: list[str], timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run servex with ``args`` (expected to exit on its own) and return its outcome."""
    cmd = [
        sys.executable,
        "-m",
        "servex.server",
        f"--port={free_port()}",
        f"--metrics_port={free_port()}",
        "--rest_api_port=0",
        "--bind_address=127.0.0.1",
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def model_config_file(directory: Path, models: dict[str, Path | str]) -> Path:
    """A TensorFlow Serving model config file in ``directory`` serving each name from its base path."""
    entries = "".join(
        f'  config {{ name: "{n}" base_path: "{p}" model_platform: "tensorflow" }}\n' for n, p in models.items()
    )
    path = directory / "models.config"
    path.write_text(f"model_config_list {{\n{entries}}}\n")
    return path


def metric(daemon: Daemon, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` on the daemon's /metrics whose labels include ``labels``
    (parsed with prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def wait_for(condition, timeout=30.0, what="condition"):
    """``condition()``'s first truthy value, asked every 0.05 s; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
