"""The test helpers' own guarantees that the daemon tests rely on (tests/support/ports.py, tests/support/daemon.py);
the restart after a port clash, with a real daemon, is in tests/integration/test_daemon_ports.py."""

import errno
import fcntl
import os
import socket

import pytest

from tests.support.daemon import free_port, port_clash
from tests.support.ports import CLAIMS, POOL, claim_ports


def test_free_ports_are_never_handed_out_twice():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_ports_come_from_below_the_ephemeral_range():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert POOL.stop <= low or low < POOL.start + 2000  # (a machine whose ephemeral range starts very low)
    assert all(port in POOL for port in (free_port() for _ in range(20)))


def test_a_daemon_s_ports_are_held_bound_until_released_and_claimed_until_retired():
    claims = claim_ports(3)
    ports = [c.port for c in claims]
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as s, pytest.raises(OSError) as info:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
        assert info.value.errno == errno.EADDRINUSE
    for c in claims:
        c.release()
    with socket.socket() as s:  # released: the daemon can bind it
        s.bind(("127.0.0.1", ports[0]))
    # Still claimed: another test process cannot take the claim file's lock.
    fd = os.open(CLAIMS / str(ports[0]), os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for c in claims:
            c.retire()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # retired: free for other processes (not this one)
    finally:
        os.close(fd)


def test_a_port_clash_is_told_from_servex_s_log_lines_of_the_helper_s_ports_only():
    log = "E cannot bind gRPC to 127.0.0.1:23456: [Errno 98] Address already in use\n"
    assert port_clash(log, [23456, 23457])
    assert not port_clash(log, [23457])
    assert port_clash("cannot bind metrics to 127.0.0.1:23457: [Errno 98] Address in use", [23457])
    assert port_clash("cannot bind REST to 127.0.0.1:23458: [Errno 98] Address already in use", [23458])
    assert port_clash("cannot bind the admin port to 127.0.0.1:23459: no", [23459])
    assert not port_clash("cannot bind gRPC to unix:/tmp/x.sock: taken 23460", [23460])
