"""Start the real servex daemon (``python -m servex.server``) as a subprocess on loopback ports that cannot collide
(tests/support/ports.py), and wait until it serves; a start that failed because another process took one of its
ports first is retried on fresh ports.

Most of a start is the import of TensorFlow (3 s on an idle core, three times that on a busy one). The fixtures
(tests/support/fixtures.py) start their daemons with ``spare=True``: the daemon then runs in a *spare*, a Python
process started ahead (when the previous daemon was handed out) that has imported servex's server modules, and
TensorFlow with them, as servex's own start would, and waits for its flags; it then runs ``servex.server`` as
``python -m`` runs it (``runpy``), with the test process's environment of that moment, in the project root. So the
import of the next daemon runs while the tests run on the current one. Tests of the start itself (signals during
the import, process groups, what a start prints) use fresh processes: ``Daemon``'s default, and ``run_to_exit``.

Daemons run on ``DAEMON_PYTHON``: the test's own Python, or the one ``SERVEX_TEST_DAEMON_PYTHON`` names (CI's
second pass runs every daemon on an environment with the oldest protobuf and grpcio servex admits, while the test
process keeps the clients' own).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.paths import REPO
from tests.support.ports import Claim, claim_ports, free_port

__all__ = [
    "START_TIMEOUT_S",
    "Daemon",
    "free_port",
    "listening_sockets",
    "metric",
    "model_config_file",
    "port_clash",
    "run_to_exit",
    "terminate",
    "wait_for",
]

START_TIMEOUT_S = 120
START_ATTEMPTS = 5  # starts on fresh ports after a port clash, before giving up

# servex's log line when it cannot bind a port: "cannot bind gRPC to 127.0.0.1:8500: ...", "... REST to ...",
# "... metrics to ...", "cannot bind the admin port to ..." (server/app.py); a UNIX socket's has no port.
_CANNOT_BIND = re.compile(r"cannot bind [^\n]*? to (?:\[[0-9a-fA-F:.]+\]|[\w.\-]+):(\d+)")


def port_clash(output: str, ports) -> bool:
    """Whether servex's ``output`` says it could not bind one of ``ports`` (ports the helper chose, not the test)."""
    return any(int(m.group(1)) in set(ports) for m in _CANNOT_BIND.finditer(output))


DAEMON_PYTHON = os.environ.get("SERVEX_TEST_DAEMON_PYTHON") or sys.executable
# Flags every daemon gets before its own (say, --max_memory_bytes=... to run the tests with admission on).
DAEMON_FLAGS = os.environ.get("SERVEX_TEST_DAEMON_FLAGS", "").split()


def _servex(ports: dict[str, int], args: list[str]) -> list[str]:
    return [DAEMON_PYTHON, "-m", "servex.server", *(f"{flag}={port}" for flag, port in ports.items()),
            "--bind_address=127.0.0.1", *DAEMON_FLAGS, *args]  # fmt: skip


def _flags(rest: bool, port_flags) -> list[str]:
    return ["--port", "--metrics_port", *(["--rest_api_port"] if rest else []), *port_flags]


# What servex's main does before its import of TensorFlow (server/cli.py: the environment defaults, then
# servex.server.app), then the order from stdin: the environment, where the output goes (the import's output first,
# as a fresh process's would be), and the flags to run servex.server with, as `python -m servex.server` runs it.
_SPARE = """
import json, os, runpy, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import servex.server.app
order = sys.stdin.readline()
if not order:
    sys.exit(0)
order = json.loads(order)
sys.stdout.flush()
sys.stderr.flush()
flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
out = os.open(order["stdout"], flags)
err = out if order["stderr"] == order["stdout"] else os.open(order["stderr"], flags)
with open(sys.argv[1], "rb") as imported:
    os.write(err, imported.read())
os.dup2(out, 1)
os.dup2(err, 2)
os.unlink(sys.argv[1])
devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)
os.environ.clear()
os.environ.update(order["env"])
sys.argv = ["-m", *order["args"]]
runpy.run_module("servex.server", run_name="__main__", alter_sys=True)
"""


def _environment() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _import_environment() -> dict[str, str]:
    """The environment as far as an import can see it: pytest's PYTEST_CURRENT_TEST (the test and its phase,
    changed at every step) aside."""
    env = _environment()
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


class _Spare:
    """A Python process that has imported servex's server modules (TensorFlow among them) and waits on stdin for
    its order: where its output goes and the flags to run servex.server with."""

    folder: Path | None = None

    def __init__(self):
        if _Spare.folder is None:
            _Spare.folder = Path(tempfile.mkdtemp(prefix="servex-spares-"))
        fd, name = tempfile.mkstemp(prefix="import-", suffix=".log", dir=_Spare.folder)
        self.imported = Path(name)
        self.env = _import_environment()
        self.proc = subprocess.Popen([DAEMON_PYTHON, "-c", _SPARE, name], cwd=REPO, stdin=subprocess.PIPE, stdout=fd,
                                     stderr=subprocess.STDOUT, env=_environment())  # fmt: skip
        os.close(fd)

    def run(self, args: list[str], stdout: Path, stderr: Path | None = None) -> subprocess.Popen:
        """Run servex with ``args`` (its flags), its output appended to ``stdout`` and ``stderr`` (or both to
        ``stdout``)."""
        order = {"env": _environment(), "args": args, "stdout": str(stdout), "stderr": str(stderr or stdout)}
        self.proc.stdin.write(json.dumps(order).encode() + b"\n")
        self.proc.stdin.close()
        return self.proc

    def discard(self) -> None:
        self.proc.stdin.close()  # it exits at the end of its input
        terminate(self.proc, timeout=10)
        self.imported.unlink(missing_ok=True)


_spare_lock = threading.Lock()
_spare: _Spare | None = None


def _take_spare() -> _Spare | None:
    """The spare, if one is alive and was started with this process's environment as it is now (else a fresh start
    has it as it is now); a new one starts for the next daemon."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
        if spare is not None and (spare.proc.poll() is not None or spare.env != _import_environment()):
            spare.discard()
            spare = None
        _spare = _Spare()
    return spare


def _group(args) -> bool:
    """Whether ``args`` start a process group, whose supervisor must not import TensorFlow: never in a spare."""
    return any(a.startswith("--serving_processes") and a != "--serving_processes=1" for a in args)


@atexit.register
def _discard_spare() -> None:
    global _spare
    with _spare_lock:
        if _spare is not None:
            _spare.discard()
            _spare = None


class Daemon:
    """A running `servex` process; ``args`` are its flags beyond the ports and bind address. With ``rest``, its
    REST API listens on a port of its own (``rest_port``, ``rest_url``); else REST is off. ``port_flags`` names
    more port flags to give fresh ports (``--admin_port``, say): ``ports[flag]`` is each one's, and
    ``admin_port`` the admin one's. ``channel`` talks to its gRPC port, over TLS with ``credentials`` (gRPC
    channel credentials; the daemon's --ssl_config_file is in ``args``).

    The process starts here; ``wait_serving`` waits until its health is SERVING and, should it exit because a
    port it was given was taken in the meantime (its ``cannot bind`` log line), starts it again on fresh ports.
    With ``spare``, servex runs in a spare process that has imported TensorFlow already (the module's docstring);
    never for a process group (--serving_processes), whose supervisor imports no TensorFlow."""

    def __init__(
        self,
        args: list[str],
        log_dir: Path,
        rest: bool = False,
        credentials=None,
        port_flags=(),
        spare: bool = False,
        prefix=(),
    ):
        self.args = list(args)
        self.prefix = list(prefix)  # a command that execs servex's (say, into a cgroup): never a spare then
        self.spare = spare and not _group(self.args) and not self.prefix
        self.log_dir = log_dir
        self.rest = rest
        self.credentials = credentials
        self.port_flags = tuple(port_flags)
        self.attempts = 0
        self.proc: subprocess.Popen | None = None
        self._claims: list[Claim] = []
        self._start()

    def _start(self) -> None:
        self.attempts += 1
        flags = _flags(self.rest, self.port_flags)
        self._claims = claim_ports(len(flags))
        self.ports = {flag: c.port for flag, c in zip(flags, self._claims, strict=True)}
        self.port = self.ports["--port"]
        self.metrics_port = self.ports["--metrics_port"]
        self.rest_port = self.ports.get("--rest_api_port", 0)
        self.admin_port = self.ports.get("--admin_port", 0)
        self.rest_url = f"http://127.0.0.1:{self.rest_port}"
        self.address = f"127.0.0.1:{self.port}"
        cmd = _servex(dict(self.ports, **({} if self.rest else {"--rest_api_port": 0})), self.args)
        self.log_path = self.log_dir / f"servex-{self.port}.log"
        self._log = open(self.log_path, "wb")
        spare = _take_spare() if self.spare else None
        for c in self._claims:  # all together, just before servex binds them
            c.release()
        if spare is not None:
            self.proc = spare.run(cmd[3:], self.log_path)  # the flags (after python -m servex.server)
        else:
            self.proc = subprocess.Popen([*self.prefix, *cmd], cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                         env=_environment())  # fmt: skip
        if self.credentials is None:
            self.channel = grpc.insecure_channel(self.address)
        else:
            self.channel = grpc.secure_channel(self.address, self.credentials)

    def _retire(self) -> None:
        self.channel.close()
        self._log.close()
        for c in self._claims:
            c.retire()

    def clashed(self) -> bool:
        """Whether the process exited because one of the ports this helper gave it was taken."""
        return self.proc.poll() is not None and port_clash(self.log(), self.ports.values())

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> Daemon:
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.clashed() and self.attempts < START_ATTEMPTS:
                    self._retire()
                    self._start()
                    stub = health_pb2_grpc.HealthStub(self.channel)
                    continue
                raise RuntimeError(f"servex exited with {self.proc.returncode} before serving:\n{self.log()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"servex did not become SERVING within {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int:
        self.channel.close()
        terminate(self.proc)
        self._retire()
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
    return len(accept_queues(port))


def accept_queues(port: int) -> list[int]:
    """The connections waiting to be accepted on each socket listening on ``port`` on this machine (the IPv4 and
    IPv6 tables of /proc/net, where a listener's rx_queue is its accept queue)."""
    queues = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)  # the header
            for line in f:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    queues.append(int(fields[4].split(":")[1], 16))
    return queues


def run_to_exit(args: list[str], timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run servex with ``args`` (expected to exit on its own) and return its outcome (text ``stdout`` and
    ``stderr``), in a spare process that has imported TensorFlow already unless ``args`` start a process group;
    started again on fresh ports when it exited because one of the ports this helper gave it was taken (not one
    that ``args`` set)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        claims = claim_ports(2)
        ports = {"--port": claims[0].port, "--metrics_port": claims[1].port}
        cmd = _servex(dict(ports, **{"--rest_api_port": 0}), args)
        try:
            out = _run(cmd, timeout, claims)
        finally:
            for c in claims:
                c.retire()
        if out.returncode == 0 or attempt == START_ATTEMPTS or not port_clash(out.stdout + out.stderr, ports.values()):
            return out
    raise AssertionError("unreachable")


def _run(cmd: list[str], timeout: float, claims: list[Claim]) -> subprocess.CompletedProcess:
    spare = None if _group(cmd) else _take_spare()
    for c in claims:
        c.release()
    if spare is None:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_environment())
    with tempfile.TemporaryDirectory(prefix="servex-run-") as folder:
        stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
        proc = spare.run(cmd[3:], stdout, stderr)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(cmd, proc.returncode, read(stdout), read(stderr))


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
