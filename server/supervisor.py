"""Several serving processes on the same ports (``--serving_processes N``, N > 1).

One Python process serves gRPC from one event-loop thread, and that thread, not TensorFlow, is what limits
throughput for small models. With N > 1 the process started by the user becomes a supervisor (no TensorFlow in
it): it starts N copies of servex with the same flags on the same ports, with SO_REUSEPORT so that the kernel
spreads incoming connections over them, and serves ``/metrics`` itself, adding up what every process records
(prometheus_client's multiprocess mode). Each process loads its own copy of the models, binds its ports only once
they are loaded, tells the supervisor when it serves (``group.py``), and drains on SIGTERM as a single servex does.

- SIGTERM / SIGINT go to every process; the supervisor exits once all have drained: 0 when all exited 0.
- The group's start is all or nothing: until every process has served once, one that exits (a crash, no model
  loaded) stops the whole group with its exit code, as a single servex's failed start would.
- After that, a process that dies (SIGKILL, the OOM killer, a crash) is replaced in its slot (same CPU, same UNIX
  socket); only the calls it was running fail, the others serve on. A slot whose process keeps dying waits before
  each new start: 1 s, doubling up to 30 s, back to 1 s once a process of it has served 30 s.
- ``/metrics`` says how many serve: ``servex_serving_processes{state}`` and
  ``servex_serving_process_restarts_total{reason}``. gRPC health is each serving process's own: SERVING while any
  serves, since the ports are served.
- A supervisor that is killed takes its serving processes with it (they ask Linux for SIGTERM when it dies).
- What must reach every process is refused: the admin API (it would change one process only) at start, and
  ModelService.HandleReloadConfigRequest at call time; change the models through ``--model_config_file`` (every
  process re-reads it) or the version folders (every process polls them).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from servex.server import group
from servex.server.affinity import group_index
from servex.server.config.settings import ServerSettings
from servex.server.transport.listeners import refuse_if_served, refuse_if_taken

log = logging.getLogger("servex.supervisor")

POLL_S = 0.2
BACKOFF_MIN_S = 1.0  # a slot's first wait before it starts a process again
BACKOFF_MAX_S = 30.0  # the wait doubles up to this while the slot's processes keep dying
STABLE_S = 30.0  # a process that served this long sets its slot's wait back to BACKOFF_MIN_S

STARTING, SERVING, BACKOFF = "starting", "serving", "backoff"
STATES = (SERVING, STARTING, BACKOFF)
REASONS = ("signal", "exit")  # a process killed by a signal, or one that exited (any code)


class Slot:
    """One of the N places of the group: the process in it now, its state, and its restart back-off."""

    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.alive = False  # its process runs, or ended unseen yet
        self.ready_fd: int | None = None  # the read end of the process's ready pipe
        self.state = STARTING
        self.started = self.ready_at = 0.0
        self.served = False  # a process of this slot has served
        self.backoff = BACKOFF_MIN_S
        self.restart_at = 0.0

    def close_pipe(self) -> None:
        if self.ready_fd is not None:
            os.close(self.ready_fd)
            self.ready_fd = None


class Supervisor:
    """Starts the serving processes, replaces those that die, and stops them all on a signal."""

    def __init__(self, settings: ServerSettings, argv: list[str], metrics_dir: str):
        self.settings = settings
        self.metrics_dir = metrics_dir
        n = settings.serving_processes
        self.env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir, **{group.SUPERVISOR_PID: str(os.getpid())})
        self.command = [sys.executable, "-m", "servex.server", *argv, "--serving_processes=1",
                        f"--process_group_size={n}", "--metrics_port=0"]  # fmt: skip
        self.slots = [Slot(index) for index in range(n)]
        self.stopping = 0  # the signal the group was stopped with
        self.exit_code = 0
        self.restarts = dict.fromkeys(REASONS, 0)

    def counts(self) -> dict[str, int]:
        """How many slots are in each state (what ``/metrics`` says)."""
        states = [slot.state for slot in self.slots]
        return {state: states.count(state) for state in STATES}

    def stop(self, signum, _frame=None) -> None:
        self.stopping = self.stopping or signum
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signum)

    def start(self, slot: Slot) -> None:
        flags = []
        cpu = self.settings.event_loop_cpu
        if cpu >= 0:
            flags.append(f"--event_loop_cpu={group_index(cpu, slot.index)}")  # each loop its own CPU
        if slot.index and self.settings.grpc_socket_path:  # the first process serves the UNIX socket
            flags.append("--grpc_socket_path=")
        read_end, write_end = os.pipe()
        env = dict(self.env, **{group.READY_FD: str(write_end)})
        try:
            slot.proc = subprocess.Popen(self.command + flags, env=env, pass_fds=(write_end,))
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the process holds its own: the pipe ends when it does
        slot.ready_fd, slot.state, slot.started, slot.alive = read_end, STARTING, time.monotonic(), True
        if self.stopping:  # a signal came while the process was being started, before the slot held it
            slot.proc.send_signal(self.stopping)

    def run(self) -> None:
        for slot in self.slots:
            if self.stopping:  # a signal came while the group started: start no more
                break
            self.start(slot)
        pids = [slot.proc.pid for slot in self.slots if slot.proc is not None]
        log.info("supervising %d serving processes (pids %s) on port %d", len(self.slots), pids, self.settings.port)
        while any(slot.alive for slot in self.slots) or self._restarting():
            self._read_ready()
            now = time.monotonic()
            for slot in self.slots:
                if slot.alive and slot.proc.poll() is not None:
                    self._ended(slot, now)
                elif slot.state == BACKOFF and now >= slot.restart_at and not self.stopping:
                    self._restart(slot)

    def _restarting(self) -> bool:
        return not self.stopping and any(slot.state == BACKOFF for slot in self.slots)

    def _read_ready(self) -> None:
        """Wait up to POLL_S for a process to say it serves."""
        fds = {slot.ready_fd: slot for slot in self.slots if slot.ready_fd is not None}
        if not fds:
            time.sleep(POLL_S)
            return
        readable, _, _ = select.select(list(fds), [], [], POLL_S)  # a signal's handler runs, then it goes on
        for fd in readable:
            slot = fds[fd]
            ready = os.read(fd, 1) == group.READY
            slot.close_pipe()  # ready, or the process closed it (it died: poll() sees it)
            if ready and slot.proc is not None and slot.proc.poll() is None:
                slot.state, slot.ready_at, slot.served = SERVING, time.monotonic(), True
                counts = self.counts()
                log.info("serving process %d (pid %d) serves: %d of %d serving", slot.index, slot.proc.pid,
                         counts[SERVING], len(self.slots))  # fmt: skip

    def _ended(self, slot: Slot, now: float) -> None:
        """The process of ``slot`` ended: the group stops (when it was stopping, or had not started yet), or the
        slot waits to start another."""
        proc, was_serving = slot.proc, slot.state == SERVING
        slot.alive = False
        slot.close_pipe()
        _forget_gauges(self.metrics_dir, proc.pid)
        if self.stopping:
            return
        how = _how(proc.returncode)
        if not all(s.served for s in self.slots):  # the group's start: all or nothing
            log.error("serving process %d (pid %d) %s before the group served: stopping the group", slot.index,
                      proc.pid, how)  # fmt: skip
            self.exit_code = proc.returncode if proc.returncode > 0 else 1
            self.stop(signal.SIGTERM)
            return
        served_for = now - slot.ready_at if was_serving else 0.0
        if served_for >= STABLE_S:
            slot.backoff = BACKOFF_MIN_S
        wait, slot.backoff = slot.backoff, min(slot.backoff * 2, BACKOFF_MAX_S)
        self.restarts["signal" if proc.returncode < 0 else "exit"] += 1
        slot.state, slot.restart_at = BACKOFF, now + wait
        counts = self.counts()
        log.error("serving process %d (pid %d) %s after %s: starting another in %.0f s (%d of %d serving)",
                  slot.index, proc.pid, how, f"serving {served_for:.1f} s" if was_serving else "never serving",
                  wait, counts[SERVING], len(self.slots))  # fmt: skip

    def _restart(self, slot: Slot) -> None:
        old = slot.proc.pid
        try:
            self.start(slot)
        except OSError as e:  # no memory to fork, say: try again later
            slot.restart_at = time.monotonic() + slot.backoff
            log.error("cannot start serving process %d again: %s", slot.index, e)
            return
        log.warning("serving process %d restarted: pid %d replaces pid %d", slot.index, slot.proc.pid, old)

    def return_codes(self) -> list[int]:
        """The exit status of each process that ran when the group stopped (not those of slots waiting to start
        another); a process that the signal it was sent ended (before it could take it over to drain) stopped as
        asked: 0."""
        codes = [slot.proc.returncode for slot in self.slots if slot.proc is not None and slot.state != BACKOFF]
        return [0 if self.stopping and code == -self.stopping else code for code in codes]

    def kill_all(self) -> None:
        for slot in self.slots:
            slot.close_pipe()
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()
                slot.proc.wait()


def supervise(settings: ServerSettings, argv: list[str]) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="servex-metrics-")
    supervisor = Supervisor(settings, argv, metrics_dir)
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    metrics_server = None
    try:  # whatever fails from here on, no serving process outlives the supervisor
        metrics_server = _start_metrics(settings, metrics_dir, supervisor)  # first: a taken port starts no process
        # The processes share their ports with SO_REUSEPORT, which would let them in beside another server (a
        # second servex group, say) instead of failing: a port some other process listens on stops the group.
        refuse_if_taken(settings.bind_address, settings.port)
        if settings.rest_api_port:
            refuse_if_taken(settings.bind_address, settings.rest_api_port)
        if settings.grpc_socket_path:
            refuse_if_served(settings.grpc_socket_path)
        _migration_hint()
        supervisor.run()
    except OSError as e:  # e.g. the metrics port is taken
        log.error("cannot run the serving processes: %s", e)
        supervisor.exit_code = 1
        supervisor.stop(signal.SIGTERM)
        _wait_all([s.proc for s in supervisor.slots if s.proc is not None], settings.drain_seconds + 10)
    finally:
        supervisor.kill_all()
        if metrics_server is not None:
            metrics_server.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    codes = supervisor.return_codes()
    exit_code = supervisor.exit_code or next((c for c in codes if c), 0)
    log.info("serving processes exited with %s", codes)
    return exit_code


def _migration_hint() -> None:
    """Say so where Linux resets, rather than hands to the other processes, the connections a dying serving
    process had not accepted yet (net.ipv4.tcp_migrate_req, Linux 5.14+)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_migrate_req") as f:
            migrate = f.read().strip()
    except OSError:
        return
    if migrate == "0":
        log.info("net.ipv4.tcp_migrate_req is 0: connections a serving process has not accepted yet when it "
                 "dies are reset, not handed to the others (docs/processes.md: Several serving processes)")  # fmt: skip


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with {returncode}"


def _forget_gauges(metrics_dir: str, pid: int) -> None:
    """Drop a dead process's live gauges from /metrics (its counters and histograms stay in the sums)."""
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(pid, metrics_dir)
    except OSError as e:  # /metrics keeps them: nothing else suffers
        log.warning("cannot drop the gauges of serving process pid %d from /metrics: %s", pid, e)


def _wait_all(children: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


class GroupCollector:
    """The supervisor's own metrics: its serving processes by state, and how many were replaced."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        processes = GaugeMetricFamily(
            "servex_serving_processes",
            "Slots of the process group (--serving_processes) by state: serving, starting (started, models not in "
            "yet), backoff (its process died; waiting to start another)",
            labels=["state"],
        )
        for state, count in self.supervisor.counts().items():
            processes.add_metric([state], count)
        yield processes
        restarts = CounterMetricFamily(
            "servex_serving_process_restarts",
            "Serving processes that died after the group served and were replaced, by reason: signal (killed, "
            "e.g. SIGKILL or the OOM killer), exit (exited on their own, any code)",
            labels=["reason"],
        )
        for reason, count in self.supervisor.restarts.items():
            restarts.add_metric([reason], count)
        yield restarts


def _start_metrics(settings: ServerSettings, metrics_dir: str, supervisor: Supervisor):
    """/metrics over what every serving process wrote to ``metrics_dir``, and the supervisor's own."""
    if not settings.metrics_port:
        return None
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    registry.register(GroupCollector(supervisor))
    server, _thread = start_http_server(settings.metrics_port, addr=settings.bind_address, registry=registry)
    log.info("Prometheus metrics of all serving processes on http://%s:%d/metrics", settings.bind_address,
             settings.metrics_port)  # fmt: skip
    return server
