"""What /proc says about the processes of a servex process group (--serving_processes): its supervisor's children,
their state and the TCP connections each holds (psutil is not installed)."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """The children of process ``pid``'s main thread (the supervisor starts its serving processes from it)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def describe(pid: int) -> str:
    """A process's state, parent and command line from /proc (or that it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    state, parent = stat.rsplit(")", 1)[1].split()[:2]
    return f"state {state}, parent {parent}: {cmdline[:200]}"


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: no longer in /proc, or a zombie its (new) parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def environment(pid: int) -> dict[str, str]:
    """Process ``pid``'s environment as it was started."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def established_on(pid: int, port: int) -> int:
    """Established TCP connections that process ``pid`` holds on local port ``port`` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count
