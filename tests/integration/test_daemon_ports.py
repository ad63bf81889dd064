"""The daemon helper's guarantee that a port clash never fails a test: servex exits when another process took one of
its ports between their release and its bind (``cannot bind``), and the helper starts it again on fresh ports."""

from __future__ import annotations

import socket

import pytest

from tests.support import daemon as daemon_module
from tests.support.daemon import DAEMON_PYTHON, Daemon, run_to_exit, wait_for


@pytest.fixture
def thief(monkeypatch):
    """Take the first gRPC port the helper releases (listening on it, as another server would), once."""
    taken: list[socket.socket] = []
    claim_ports = daemon_module.claim_ports

    def claim_then_steal(count):
        claims = claim_ports(count)
        if not taken:
            first = claims[0]
            release = first.release

            def release_and_steal():
                release()
                if taken:  # (retire releases again)
                    return
                s = socket.socket()
                s.bind(("127.0.0.1", first.port))
                s.listen()
                taken.append(s)

            first.release = release_and_steal
        return claims

    monkeypatch.setattr(daemon_module, "claim_ports", claim_then_steal)
    yield taken
    for s in taken:
        s.close()


def test_a_daemon_whose_port_was_taken_starts_again_on_fresh_ports(thief, tmp_path):
    daemon = Daemon([], tmp_path).wait_serving()
    try:
        stolen = thief[0].getsockname()[1]
        assert daemon.attempts == 2
        assert daemon.port != stolen and stolen not in daemon.ports.values()
        assert f"cannot bind gRPC to 127.0.0.1:{stolen}" in (tmp_path / f"servex-{stolen}.log").read_text()
    finally:
        daemon.stop()


def test_run_to_exit_starts_again_when_a_port_it_chose_was_taken(thief, tmp_path):
    out = run_to_exit([f"--model_base_path={tmp_path / 'missing'}"])  # binds its ports, then fails to load
    assert thief, "the first start's gRPC port was taken"
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "nothing to serve" in text and "cannot bind" not in text  # the second start's outcome, on other ports


def test_a_port_the_test_gave_is_not_retried(thief):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_to_exit([f"--port={port}"])
    assert out.returncode == 1
    assert f"cannot bind gRPC to 127.0.0.1:{port}" in out.stdout + out.stderr


@pytest.fixture
def first(tmp_path):
    """A daemon started in the fixture's phase (pytest's PYTEST_CURRENT_TEST says setup): a spare starts for the
    next one."""
    daemon = Daemon([], tmp_path, spare=True)
    yield daemon
    daemon.stop()


def test_the_next_daemon_runs_in_the_spare_started_for_it(first, tmp_path):
    second = Daemon([], tmp_path, spare=True)  # in the test's own phase: the environment differs in that alone
    try:
        assert second.proc.args[:2] == [DAEMON_PYTHON, "-c"]  # the spare, not a fresh `python -m servex.server`
        second.wait_serving()
        first.wait_serving()
        wait_for(lambda: "servex ready" in second.log(), what="servex ready in the log")
    finally:
        second.stop()
