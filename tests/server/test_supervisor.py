"""server/supervisor.py's decisions when a serving process ends (without processes: test_process_restart.py runs
real ones): the start is all or nothing, later deaths wait 1 s doubling up to 30 s before the next start, back to
1 s after 30 s of service; and the metrics that say so. server/group.py's link to the supervisor."""

from __future__ import annotations

import os
import signal

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from servex.server import group
from servex.server.config.settings import ServerSettings
from servex.server.supervisor import BACKOFF, SERVING, STARTING, GroupCollector, Supervisor


class FakeProcess:
    def __init__(self, pid: int, returncode: int | None = None):
        self.pid = pid
        self.returncode = returncode
        self.signals: list[int] = []

    def poll(self):
        return self.returncode

    def send_signal(self, signum):
        self.signals.append(signum)


@pytest.fixture
def supervisor(tmp_path):
    return Supervisor(ServerSettings(serving_processes=2), ["--model_name=m"], str(tmp_path))


def _served(supervisor: Supervisor) -> None:
    for index, slot in enumerate(supervisor.slots):
        slot.proc, slot.alive, slot.state, slot.served, slot.ready_at = FakeProcess(100 + index), True, SERVING, True, 0


def _die(supervisor: Supervisor, index: int, returncode: int, now: float) -> float:
    """Process ``index`` ended with ``returncode`` at ``now``: the wait before its slot starts another."""
    slot = supervisor.slots[index]
    slot.proc.returncode = returncode
    supervisor._ended(slot, now)
    assert slot.state == BACKOFF and not supervisor.stopping
    return slot.restart_at - now


def _replaced(supervisor: Supervisor, index: int, pid: int, serving_since: float | None = None) -> None:
    slot = supervisor.slots[index]
    slot.proc, slot.alive = FakeProcess(pid), True
    slot.state = SERVING if serving_since is not None else STARTING
    slot.ready_at = serving_since or 0.0


def test_a_slot_whose_processes_keep_dying_waits_longer_each_time(supervisor):
    _served(supervisor)
    waits = [_die(supervisor, 0, -signal.SIGKILL, now=5.0)]
    for attempt in range(7):  # each replacement dies during its start
        _replaced(supervisor, 0, 200 + attempt)
        waits.append(_die(supervisor, 0, 1, now=10.0 + attempt))
    assert waits == [1, 2, 4, 8, 16, 30, 30, 30]
    assert supervisor.restarts == {"signal": 1, "exit": 7}
    assert supervisor.counts() == {SERVING: 1, STARTING: 0, BACKOFF: 1}
    _replaced(supervisor, 0, 300, serving_since=100.0)
    assert _die(supervisor, 0, -signal.SIGSEGV, now=100.0 + 29) == 30  # served, but not long: still waits
    _replaced(supervisor, 0, 301, serving_since=200.0)
    assert _die(supervisor, 0, -signal.SIGKILL, now=200.0 + 30) == 1  # served 30 s: back to 1 s
    assert supervisor.slots[1].state == SERVING  # the other slot is left alone


def test_a_process_that_ends_before_the_group_served_stops_the_group(supervisor):
    _served(supervisor)
    supervisor.slots[1].served = False  # still starting
    supervisor.slots[1].state = STARTING
    supervisor.slots[1].proc.returncode = 3
    supervisor._ended(supervisor.slots[1], 1.0)
    assert supervisor.stopping == signal.SIGTERM and supervisor.exit_code == 3
    assert supervisor.slots[0].proc.signals == [signal.SIGTERM]
    assert supervisor.restarts == {"signal": 0, "exit": 0}


def test_processes_that_end_while_the_group_stops_are_not_replaced(supervisor):
    _served(supervisor)
    supervisor.stop(signal.SIGTERM)
    supervisor.slots[0].proc.returncode = -signal.SIGTERM  # before it could take the signal over
    supervisor.slots[1].proc.returncode = 0
    for slot in supervisor.slots:
        supervisor._ended(slot, 1.0)
    assert not supervisor._restarting() and supervisor.restarts == {"signal": 0, "exit": 0}
    assert supervisor.return_codes() == [0, 0]


def test_the_metrics_count_the_slots_by_state_and_the_restarts(supervisor):
    _served(supervisor)
    _die(supervisor, 1, -signal.SIGKILL, now=3.0)
    registry = CollectorRegistry()
    registry.register(GroupCollector(supervisor))
    text = generate_latest(registry).decode()
    for line in ('servex_serving_processes{state="serving"} 1.0', 'servex_serving_processes{state="backoff"} 1.0',
                 'servex_serving_processes{state="starting"} 0.0',
                 'servex_serving_process_restarts_total{reason="signal"} 1.0',
                 'servex_serving_process_restarts_total{reason="exit"} 0.0'):  # fmt: skip
        assert line in text, text


def test_a_serving_process_tells_the_supervisor_once_it_serves(monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setenv(group.READY_FD, str(write_end))
    monkeypatch.setenv(group.SUPERVISOR_PID, str(os.getppid()))  # this test process's parent stands in for it
    monkeypatch.setattr(group, "_set_parent_death_signal", lambda signum: True)
    monkeypatch.setattr(group.atexit, "register", lambda *args: None)
    try:
        group.follow_supervisor()
        assert group.READY_FD not in os.environ and group.SUPERVISOR_PID not in os.environ
        group.notify_ready()
        group.notify_ready()  # once only
        assert os.read(read_end, 10) == group.READY
        assert os.read(read_end, 10) == b""  # its end is closed
    finally:
        os.close(read_end)


def test_a_serving_process_whose_supervisor_is_gone_exits(monkeypatch):
    monkeypatch.setenv(group.SUPERVISOR_PID, str(os.getppid() + 1_000_000))
    monkeypatch.setattr(group, "_set_parent_death_signal", lambda signum: True)
    monkeypatch.setattr(group.atexit, "register", lambda *args: None)
    with pytest.raises(SystemExit):
        group.follow_supervisor()


def test_the_metrics_folder_is_removed_after_a_dead_supervisor_only(tmp_path, monkeypatch):
    monkeypatch.setattr(group.tempfile, "gettempdir", lambda: str(tmp_path))
    folder = tmp_path / "servex-metrics-x"
    folder.mkdir()
    group._clean_up_after(os.getppid(), str(folder))  # the parent lives: the folder is its
    assert folder.is_dir()
    group._clean_up_after(os.getppid() + 1_000_000, str(folder))  # not this process's parent: it died
    assert not folder.exists()
    other = tmp_path / "mine"
    other.mkdir()
    group._clean_up_after(os.getppid() + 1_000_000, str(other))  # a folder the supervisor did not make: kept
    assert other.is_dir()


def test_the_supervisor_imports_no_tensorflow():
    """A group's supervisor runs in its own process beside the serving ones: importing TensorFlow would cost it some
    600 MB of memory for nothing (what the command line runs for a group: server/cli.py, then this module)."""
    import subprocess
    import sys

    code = (
        "import sys, servex.server.cli, servex.server.supervisor\n"
        "heavy = ('tensorflow', 'servex.executor.graph_executor', 'servex.server.core')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
