"""--event_loop_cpu: the thread that pins is confined to its CPU, threads it starts later get the process's CPUs
back (at once and from the watcher), unpin restores it, and serving processes of a group take CPUs in turn."""

from __future__ import annotations

import os
import threading
import time

import pytest

from servex.server import affinity
from servex.server.affinity import LoopPin, _ranges, group_index, resolve

ALLOWED = os.sched_getaffinity(0)
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning one CPU out of one changes nothing")


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


def test_ranges_as_proc_writes_them():
    assert _ranges({0}) == "0"
    assert _ranges({0, 1, 2, 5}) == "0-2,5"
    assert _ranges({3, 7, 8}) == "3,7-8"


def test_the_flag_names_a_cpu_by_its_index_among_the_allowed_ones(monkeypatch):
    assert [resolve(i) for i in range(len(ALLOWED))] == sorted(ALLOWED)
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: {4, 5})  # a container given CPUs 4-5
    assert (resolve(0), resolve(1)) == (4, 5)
    with pytest.raises(ValueError, match=r"--event_loop_cpu=2: this process may run on 2 CPU\(s\) \(4-5\); give an "
                       r"index from 0 to 1"):  # fmt: skip
        resolve(2)
    with pytest.raises(ValueError, match="--event_loop_cpu=-2"):
        LoopPin(-2)


def test_group_processes_take_the_allowed_cpus_in_turn():
    last = len(ALLOWED) - 1
    taken = [group_index(last, i) for i in range(len(ALLOWED) + 1)]
    assert taken[0] == last
    assert sorted(taken[: len(ALLOWED)]) == list(range(len(ALLOWED)))  # each CPU once before any twice
    assert taken[len(ALLOWED)] == last


class _PinnedThread(threading.Thread):
    """A stand-in for the event loop thread: pins, starts a child thread, then waits to be told to unpin."""

    def __init__(self, pin: LoopPin):
        super().__init__(daemon=True)
        self.pin = pin
        self.pinned = threading.Event()
        self.finish = threading.Event()
        self.child_started = threading.Event()
        self.child_stop = threading.Event()
        self.child_tid = 0
        self.child_inherited: set[int] = set()
        self.after_unpin: set[int] = set()

    def run(self):
        self.pin.pin()
        self.pinned.set()
        child = threading.Thread(target=self._child, daemon=True)
        child.start()
        self.finish.wait(10)
        self.pin.unpin()
        self.after_unpin = _affinity(0)
        self.child_stop.set()
        child.join()

    def _child(self):
        self.child_tid = threading.get_native_id()
        self.child_inherited = _affinity(0)
        self.child_started.set()
        self.child_stop.wait(10)


@needs_two_cpus
def test_pin_confines_the_loop_thread_and_release_gives_later_threads_the_cpus_back():
    cpu = max(ALLOWED)
    pin = LoopPin(len(ALLOWED) - 1, interval=3600)  # the watcher does not run during the test: release by hand
    thread = _PinnedThread(pin)
    thread.start()
    try:
        assert thread.child_started.wait(10)
        assert _affinity(thread.native_id) == {cpu}
        assert thread.child_inherited == {cpu}  # what the kernel does: a thread inherits its creator's CPUs
        assert _affinity(threading.get_native_id()) == ALLOWED  # threads started before the pin keep theirs
        assert pin.release_others() >= 1
        assert _affinity(thread.child_tid) == ALLOWED
        assert _affinity(thread.native_id) == {cpu}  # the loop thread itself stays
        assert pin.release_others() == 0  # nothing left to release
    finally:
        thread.finish.set()
        thread.join(10)
    assert thread.after_unpin == ALLOWED


@needs_two_cpus
def test_the_watcher_releases_threads_started_after_the_pin():
    cpu = min(ALLOWED)
    pin = LoopPin(0, interval=0.05)
    thread = _PinnedThread(pin)
    thread.start()
    try:
        assert thread.child_started.wait(10)
        assert thread.child_inherited == {cpu}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _affinity(thread.child_tid) != ALLOWED:
            time.sleep(0.02)
        assert _affinity(thread.child_tid) == ALLOWED
        assert _affinity(thread.native_id) == {cpu}
    finally:
        thread.finish.set()
        thread.join(10)
    assert pin._watcher is None  # unpin stopped it


def test_pinning_to_the_only_allowed_cpu_starts_no_watcher(monkeypatch):
    only = min(ALLOWED)
    monkeypatch.setattr(affinity, "allowed_cpus", lambda: {only})
    pin = LoopPin(0)
    done = []
    worker = threading.Thread(target=lambda: (pin.pin(), done.append(pin._watcher), pin.unpin()))
    worker.start()
    worker.join(10)
    assert done == [None]


def test_without_sched_setaffinity_the_flag_is_refused_saying_why(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")  # as on macOS
    with pytest.raises(ValueError, match=r"--event_loop_cpu=0: pinning a thread needs Linux"):
        resolve(0)


@needs_two_cpus
def test_a_pin_the_kernel_refuses_leaves_the_loop_unpinned_and_no_watcher(monkeypatch):
    pin = LoopPin(0)
    monkeypatch.setattr(pin, "cpu", max(ALLOWED) + 64)  # a CPU gone since the start (a cpuset update)
    outcome = []

    def loop_thread():
        pin.pin()
        outcome.append((_affinity(0), pin._watcher))
        pin.unpin()

    worker = threading.Thread(target=loop_thread)
    worker.start()
    worker.join(10)
    assert outcome == [(ALLOWED, None)]
