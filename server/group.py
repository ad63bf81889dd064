"""A serving process's side of a process group (``--serving_processes``): what links it to its supervisor.

The supervisor (``supervisor.py``) starts each serving process with two variables in its environment:

- ``SERVEX_SUPERVISOR_PID``: its own pid. The serving process asks Linux for SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), so a supervisor that is killed (SIGKILL, the OOM killer) takes its serving
  processes down with it: each drains as on a SIGTERM, and none is left orphaned on the ports. Where the parent
  died before the call, the process exits at once. The last thing it does is to remove the folder of the
  group's metrics that the dead supervisor left.
- ``SERVEX_READY_FD``: the write end of a pipe. The process writes one byte to it once it serves (models loaded,
  ports open), and the supervisor counts it serving from then on; its end of the pipe closes when the process dies.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

SUPERVISOR_PID = "SERVEX_SUPERVISOR_PID"
READY_FD = "SERVEX_READY_FD"
READY = b"R"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = logging.getLogger("servex")

_ready_fd: int | None = None


def follow_supervisor() -> None:
    """In a serving process the supervisor started, die with the supervisor, and keep the pipe to tell it when this
    process serves; elsewhere, nothing."""
    global _ready_fd
    fd = os.environ.pop(READY_FD, "")
    if fd:
        _ready_fd = int(fd)
        os.set_inheritable(_ready_fd, False)  # nothing this process starts holds it open
    supervisor = os.environ.pop(SUPERVISOR_PID, "")
    if not supervisor:
        return
    atexit.register(_clean_up_after, int(supervisor), os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))
    if not _set_parent_death_signal(signal.SIGTERM):
        threading.Thread(target=_watch_parent, args=(int(supervisor),), name="servex-parent", daemon=True).start()
    if os.getppid() != int(supervisor):  # it died before the call above: no signal will come
        log.error("the supervisor (pid %s) is gone: exiting", supervisor)
        sys.exit(1)


def notify_ready() -> None:
    """Tell the supervisor, if any, that this process serves (once)."""
    global _ready_fd
    fd, _ready_fd = _ready_fd, None
    if fd is None:
        return
    try:
        os.write(fd, READY)
    except OSError as e:  # the supervisor is gone (it would have stopped this process): nothing to tell
        log.warning("cannot tell the supervisor that this process serves: %s", e)
    finally:
        os.close(fd)


def _set_parent_death_signal(signum: int) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent dies; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0:
            return True
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        log.warning("prctl(PR_SET_PDEATHSIG) is not available: %s", e)
    return False


def _clean_up_after(supervisor: int, metrics_dir: str) -> None:
    """At exit: where the supervisor died, remove the temporary folder of the group's metrics that it made (the
    processes still running keep the files they have open)."""
    made = os.path.basename(metrics_dir).startswith("servex-metrics-")
    if made and os.path.dirname(metrics_dir) == tempfile.gettempdir() and _gone(supervisor):
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _gone(supervisor: int) -> bool:
    """Whether the supervisor has died, or is dying: this process was handed to another parent, or the
    supervisor's main thread (the one that started this process) has ended, its other threads ending with it
    (this process is then still its child)."""
    if os.getppid() != supervisor:
        return True
    if not os.path.isdir("/proc"):  # no way to tell: it is alive
        return False
    try:
        with open(f"/proc/{supervisor}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _watch_parent(supervisor: int) -> None:
    """Where no parent-death signal can be asked for: SIGTERM to this process once its parent changes."""
    while os.getppid() == supervisor:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)
