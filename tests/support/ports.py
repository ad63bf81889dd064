"""Loopback ports for the test daemons that no other process can take first.

A port found free by binding port 0 and closing the socket can be taken by any other process before the daemon
binds it (TensorFlow's import alone takes seconds). So the ports here are:

- chosen below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), which the kernel never hands
  out to a socket bound to port 0 nor to an outgoing connection, so no ordinary process takes one by chance;
- claimed across processes with an exclusive ``flock`` on a file named after the port in a shared temporary folder,
  so that two test runs on one machine (or pytest-xdist workers) never pick the same port: the claim is held until
  the daemon stops (by the kernel until the holding process exits, however it exits);
- checked free with a socket bound without SO_REUSEADDR/SO_REUSEPORT (it fails on any listener and any bound
  socket of the port), and that socket held until every port of the daemon is chosen; they are all released
  together just before the daemon starts;
- never handed out twice in one test process.

A process that binds such a port explicitly between the release and the daemon's own bind can still clash: the
daemon then exits logging ``cannot bind ... :PORT``, and tests/support/daemon.py starts it again on fresh ports.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

CLAIMS = Path(tempfile.gettempdir()) / "servex-test-ports"
FLOOR = 10_000  # below: well-known and registered services (servex's own 8500-8502 among them)

_lock = threading.Lock()
_handed_out: set[int] = set()


def _pool() -> range:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = min(low, 32768)
    return range(FLOOR, top) if top - FLOOR >= 2000 else range(FLOOR, 32768)


POOL = _pool()


class Claim:
    """One port: claimed (the lock file) and held bound (``hold``) until ``release``; ``retire`` drops the claim."""

    def __init__(self, port: int, fd: int, hold: socket.socket):
        self.port, self._fd, self._hold = port, fd, hold

    def release(self) -> None:
        """Close the holding socket: the daemon may bind the port now (the claim stays)."""
        if self._hold is not None:
            self._hold.close()
            self._hold = None

    def retire(self) -> None:
        """Release the port and drop the claim (the daemon has stopped); this process never hands it out again."""
        self.release()
        if self._fd >= 0:
            os.close(self._fd)  # closing the file drops its flock
            self._fd = -1


def _claim_file(port: int) -> int | None:
    CLAIMS.mkdir(mode=0o777, exist_ok=True)
    try:
        fd = os.open(CLAIMS / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:  # a file of another user's run: that run claimed the port once, leave it alone
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def claim() -> Claim:
    """A port claimed for this process and held bound on 127.0.0.1 (call ``release`` before the daemon binds)."""
    rng = random.Random()
    with _lock:
        for _ in range(10_000):
            port = rng.choice(POOL)
            if port in _handed_out:
                continue
            _handed_out.add(port)  # whether or not it turns out free: never offered twice
            fd = _claim_file(port)
            if fd is None:
                continue
            hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            hold.set_inheritable(False)
            try:
                hold.bind(("127.0.0.1", port))  # no SO_REUSEADDR/SO_REUSEPORT: fails on any socket of the port
            except OSError as e:
                hold.close()
                os.close(fd)
                if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
                    raise
                continue
            return Claim(port, fd, hold)
    raise RuntimeError(f"no free loopback port left in {POOL.start}-{POOL.stop - 1}")


def claim_ports(count: int) -> list[Claim]:
    """``count`` distinct claimed ports, each held bound until its ``release``."""
    return [claim() for _ in range(count)]


_kept: list[Claim] = []


def free_port() -> int:
    """A port for a flag of a daemon the caller starts itself: claimed for the rest of this test process, released
    (not held bound), and never handed out twice in it. Prefer ``Daemon(..., port_flags=...)``, which holds its
    ports until the start and starts again on fresh ones after a clash."""
    c = claim()
    c.release()
    _kept.append(c)
    return c.port
