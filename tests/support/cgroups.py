"""Memory cgroups for daemon tests: a cgroup limited to some bytes, and the command prefix that starts a process in
it (the process writes itself into the cgroup, then execs, so everything it allocates is charged there)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


@dataclass
class MemoryCgroup:
    path: Path
    v1: bool

    @property
    def prefix(self) -> list[str]:
        """A command prefix that runs the rest of the command in this cgroup."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path)]

    def peak(self) -> int:
        """The most memory the cgroup has held, in bytes (v2 before 5.19 has no peak: its current use)."""
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        if not self.v1 and not (self.path / name).exists():
            name = "memory.current"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """Processes the kernel killed in it for passing its limit."""
        text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


def _make(limit: int) -> MemoryCgroup | None:
    name = f"servex-test-{uuid.uuid4().hex[:8]}"
    if (V1 / "memory.limit_in_bytes").exists():
        path = V1 / name
        try:
            path.mkdir()
            with contextlib.suppress(OSError):  # swap accounting may be off: no memsw files
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            (path / "memory.limit_in_bytes").write_text(str(limit))
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no swapping out of the limit
            return MemoryCgroup(path, v1=True)
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
    if "memory" in (V2 / "cgroup.controllers").read_text().split() if (V2 / "cgroup.controllers").exists() else ():
        own = Path(V2, Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1].lstrip("/"))
        path = own.parent / name if own != V2 else V2 / name
        try:
            path.mkdir()
            (path / "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
            return MemoryCgroup(path, v1=False)
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup | None]:
    """A new memory cgroup limited to ``limit`` bytes, removed afterwards (its processes must have exited); None
    where this machine lets no cgroup be made (no root, no writable memory controller)."""
    group = _make(limit) if os.geteuid() == 0 else None
    try:
        yield group
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                group.path.rmdir()
