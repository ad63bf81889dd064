"""The event loop's own CPU (``--event_loop_cpu``): the thread that runs the event loop, gRPC's and REST's
calls and servex's request handling is pinned to one CPU; every other thread of the process keeps the CPUs the
process started with (the run workers, TensorFlow's pools, gRPC's threads). The flag names a CPU by its index
among those the process may run on, so the same value works in a container given CPUs 4-5 and on a whole host.

Under load the event loop thread is what limits a process (about 90% of a core at 32 callers on the MLP, the
GIL held 76% of the time, the machine ~30% idle). Left to the scheduler it moves between CPUs and shares one with
the run worker or the load; pinned, it keeps its core and its cache (measured on 2 cores, MLP, batching, 32
callers, 13 alternating pairs of runs with 8 gRPC listeners: about 6% more requests/s on average and a narrower
spread; with 32 listeners, the default since, no gain in 15 rounds of scripts/bench_peers.py). Off by
default: on a shared node where every pod sees every CPU, pods pinning to the same CPU would pile onto it; use
it on dedicated hosts or with Kubernetes' static CPU manager (a pod given whole CPUs).

Linux only (``os.sched_setaffinity`` by thread id). A thread inherits its creator's affinity, so threads the
pinned thread starts later (a thread pool growing, a model loading) would be confined to the loop's CPU too: a
watcher gives them the process's CPUs back, at once on ``pin`` and then every ``interval`` seconds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from itertools import groupby

log = logging.getLogger(__name__)


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on."""
    return os.sched_getaffinity(0)


def resolve(index: int) -> int:
    """The CPU that ``--event_loop_cpu=index`` names: the index-th (from 0) of the CPUs this process may run on, in
    order. On a host where the process may use every CPU, that is CPU ``index``; in a container given CPUs 4-5, 0
    is CPU 4. ValueError naming the allowed CPUs when there are not that many."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"--event_loop_cpu={index}: pinning a thread needs Linux (os.sched_setaffinity)")
    cpus = sorted(allowed_cpus())
    if not 0 <= index < len(cpus):
        raise ValueError(
            f"--event_loop_cpu={index}: this process may run on {len(cpus)} CPU(s) ({_ranges(cpus)}); "
            f"give an index from 0 to {len(cpus) - 1}"
        )
    return cpus[index]


def group_index(first: int, process: int) -> int:
    """The ``--event_loop_cpu`` of serving process ``process`` of a group given ``first``: the next allowed CPUs
    in turn, so that the processes' loops do not share one while there are CPUs enough."""
    return (first + process) % len(allowed_cpus())


class LoopPin:
    """Pins the thread that calls ``pin`` (the event loop's) to the ``index``-th allowed CPU (``resolve``);
    ``unpin`` undoes it."""

    def __init__(self, index: int, interval: float = 1.0):
        self.cpu = resolve(index)
        self.interval = interval
        self.others = allowed_cpus()  # what every other thread keeps
        self.loop_thread: int | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def pin(self) -> None:
        self.loop_thread = threading.get_native_id()
        if self.others == {self.cpu}:
            log.info("event loop on CPU %d, the only CPU this process may use", self.cpu)
            return
        # Started before the pin, the watcher keeps every CPU.
        self._watcher = threading.Thread(target=self._watch, name="servex-affinity", daemon=True)
        self._watcher.start()
        try:
            os.sched_setaffinity(0, {self.cpu})
        except OSError as e:  # the CPUs changed under the process (a cpuset update): serve unpinned
            log.warning("event loop not pinned to CPU %d: %s", self.cpu, e)
            self._stop_watcher()
            return
        released = self.release_others()
        log.info("event loop pinned to CPU %d; other threads on CPUs %s (%d released)",
                 self.cpu, _ranges(self.others), released)  # fmt: skip

    def release_others(self) -> int:
        """Give the process's CPUs back to every thread but the loop's that is confined to the loop's CPU (one the
        loop thread started); how many were."""
        released = 0
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            if tid == self.loop_thread:
                continue
            try:
                if os.sched_getaffinity(tid) == {self.cpu}:
                    os.sched_setaffinity(tid, self.others)
                    released += 1
            except OSError:  # the thread ended meanwhile
                continue
        return released

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.release_others()

    def unpin(self) -> None:
        if self._stop_watcher():
            os.sched_setaffinity(0, self.others)

    def _stop_watcher(self) -> bool:
        """Stop the watcher; whether one was running (the loop thread was pinned)."""
        self._stop.set()
        if self._watcher is None:
            return False
        self._watcher.join()
        self._watcher = None
        return True


def _ranges(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5" (as /proc's Cpus_allowed_list writes them)."""
    runs = [[cpu for _, cpu in run] for _, run in groupby(enumerate(sorted(cpus)), lambda pair: pair[1] - pair[0])]
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
