"""Several serving processes on the same ports (``--serving_processes N``, N > 1).

One Python process serves gRPC from one event-loop thread, and that thread, not TensorFlow, is what limits
throughput for small models. With N > 1 the process started by the user becomes a supervisor (no TensorFlow in
it): it starts N copies of servex with the same flags on the same ports, with SO_REUSEPORT so that the kernel
spreads incoming connections over them, and serves ``/metrics`` itself, adding up what every process records
(prometheus_client's multiprocess mode). Each process loads its own copy of the models, binds its ports only once
they are loaded, and drains on SIGTERM as a single servex does.

- SIGTERM / SIGINT go to every process; the supervisor exits once all have drained: 0 when all exited 0.
- A process that exits on its own (a crash, or no model loaded) stops the whole group with its exit code, so the
  orchestrator (Kubernetes) restarts it whole rather than running with fewer processes unnoticed.
- What must reach every process is refused: the admin API (it would change one process only) at start, and
  ModelService.HandleReloadConfigRequest at call time; change the models through ``--model_config_file`` (every
  process re-reads it) or the version folders (every process polls them).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from servex.server.affinity import group_index
from servex.server.config.settings import ServerSettings
from servex.server.transport.listeners import refuse_if_served, refuse_if_taken

log = logging.getLogger("servex.supervisor")

POLL_S = 0.2


def supervise(settings: ServerSettings, argv: list[str]) -> int:
    n = settings.serving_processes
    metrics_dir = tempfile.mkdtemp(prefix="servex-metrics-")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    command = [sys.executable, "-m", "servex.server", *argv, "--serving_processes=1", f"--process_group_size={n}",
               "--metrics_port=0"]  # fmt: skip
    stopping = 0  # the signal the group was stopped with
    children: list[subprocess.Popen] = []

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = stopping or signum
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    metrics_server = None
    exit_code = 0
    try:  # whatever fails from here on, no serving process outlives the supervisor
        metrics_server = _start_metrics(settings, metrics_dir)  # first: a taken port starts no process
        # The processes share their ports with SO_REUSEPORT, which would let them in beside another server (a
        # second servex group, say) instead of failing: a port some other process listens on stops the group.
        refuse_if_taken(settings.bind_address, settings.port)
        if settings.rest_api_port:
            refuse_if_taken(settings.bind_address, settings.rest_api_port)
        if settings.grpc_socket_path:
            refuse_if_served(settings.grpc_socket_path)
        for index in range(n):
            if stopping:  # a signal came while the group started: start no more
                break
            cpu = settings.event_loop_cpu
            pin = [f"--event_loop_cpu={group_index(cpu, index)}"] if cpu >= 0 else []  # each loop its own CPU
            if index and settings.grpc_socket_path:  # the first process serves the UNIX socket
                pin.append("--grpc_socket_path=")
            children.append(subprocess.Popen(command + pin, env=env))
            if stopping:  # it came while this process was being started, before the list held it
                children[-1].send_signal(stopping)
        log.info("supervising %d serving processes (pids %s) on port %d", n, [c.pid for c in children], settings.port)
        while any(child.poll() is None for child in children):
            for child in children:
                code = child.poll()
                if code is not None and not stopping:
                    log.error("serving process %d exited with %d: stopping the group", child.pid, code)
                    exit_code = code or 1
                    stop(signal.SIGTERM, None)
            time.sleep(POLL_S)
    except OSError as e:  # e.g. the metrics port is taken
        log.error("cannot run the serving processes: %s", e)
        exit_code = 1
        stop(signal.SIGTERM, None)
        _wait_all(children, settings.drain_seconds + 10)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        if metrics_server is not None:
            metrics_server.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    # A process that the signal it was sent ended (before it could take it over to drain) stopped as asked.
    codes = [0 if stopping and child.returncode == -stopping else child.returncode for child in children]
    if exit_code == 0:
        exit_code = next((c for c in codes if c), 0)
    log.info("serving processes exited with %s", codes)
    return exit_code


def _wait_all(children: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _start_metrics(settings: ServerSettings, metrics_dir: str):
    """/metrics over what every serving process wrote to ``metrics_dir``."""
    if not settings.metrics_port:
        return None
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    server, _thread = start_http_server(settings.metrics_port, addr=settings.bind_address, registry=registry)
    log.info("Prometheus metrics of all serving processes on http://%s:%d/metrics", settings.bind_address,
             settings.metrics_port)  # fmt: skip
    return server
