"""The ModelManager under concurrent config changes, polls and requests, and with the real executor."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from servex.executor import GraphExecutor
from servex.loader import ModelManager, NotFound, load_saved_model
from servex.loader.config import ModelSpec, VersionPolicy
from servex.loader.errors import Unavailable
from servex.loader.manager import AVAILABLE, LOADING
from tests.loader.manager_fakes import (
    TWO_VERSIONS,
    add_version,
    available,
    closed_versions,
    model_dir,
    spec,
)

# -- concurrency --------------------------------------------------------------------------------------------


def run_threads(*targets, timeout: float = 10.0) -> list[BaseException]:
    errors: list[BaseException] = []

    def guard(target):
        try:
            target()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "threads still running: deadlock"
    return errors


def test_concurrent_apply_config_poll_and_requests(rec, tmp_path):
    manager = ModelManager(rec.make, rec.close, max_num_load_retries=1, load_retry_interval_s=0)
    a = model_dir(tmp_path / "a", 1, 2)
    b = model_dir(tmp_path / "b", 1)
    configs = [
        [spec("a", a), spec("b", b)],
        [spec("a", a, VersionPolicy("all"))],
        [spec("b", b), spec("a", a, VersionPolicy("latest", num_versions=2))],
    ]
    stop = threading.Event()

    def applier():
        for i in range(60):
            manager.apply_config(configs[i % len(configs)])

    def poller():
        for i in range(60):
            if i == 20:
                add_version(a, 3)
            manager.poll()

    bad_leases = []

    def requester():
        while not stop.is_set():
            try:
                lease = manager.acquire("a")
            except (NotFound, Unavailable):
                continue
            if lease.servable is None:  # closed while leased
                bad_leases.append((lease.version, lease.state))
            manager.release(lease)

    req = threading.Thread(target=requester, daemon=True)
    req.start()
    errors = run_threads(applier, poller)
    stop.set()
    req.join(5)
    assert not req.is_alive()
    assert errors == []
    assert bad_leases == [], "a lease was handed out on a version out of service"

    assert manager.apply_config(configs[0]) == []
    assert manager.poll() == []
    assert available(manager, "a") == [3] and available(manager, "b") == [1]
    served = {id(manager.get("a").servable), id(manager.get("b").servable)}
    closed = [id(s) for s in rec.closed]
    assert len(closed) == len(set(closed)), "a servable was closed twice"
    assert served.isdisjoint(closed)
    assert {id(s) for s in rec.made} == served | set(closed), "a servable was dropped without being closed"


def test_requests_do_not_wait_for_a_load(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base)])
    loading, go_on = threading.Event(), threading.Event()

    def slow(name, version, path):
        if version == 2:
            loading.set()
            go_on.wait(5)

    rec.on_make = slow
    add_version(base, 2)
    poller = threading.Thread(target=manager.poll, daemon=True)
    poller.start()
    assert loading.wait(5)
    started = time.monotonic()
    assert manager.get("m").version == 1  # answered while version 2 is still loading
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(1, AVAILABLE), (2, LOADING)]
    with pytest.raises(Unavailable, match="loading"):
        manager.get("m", 2)
    # A second poll waits for the first (they are serialized) instead of loading 2 twice.
    second = threading.Thread(target=manager.poll, daemon=True)
    second.start()
    second.join(0.2)
    assert second.is_alive()
    assert time.monotonic() - started < 4
    go_on.set()
    poller.join(5)
    second.join(5)
    assert not poller.is_alive() and not second.is_alive()
    assert rec.attempts("m", 2) == 1
    assert manager.get("m").version == 2


# -- with the real executor ---------------------------------------------------------------------------------


def test_manager_serves_the_latest_reference_model(testdata):
    def make(name, version, path):
        return GraphExecutor(load_saved_model(path))

    manager = ModelManager(make, lambda executor: executor.close())
    assert manager.apply_config([ModelSpec("half_plus_two", str(TWO_VERSIONS))]) == []
    try:
        assert manager.get("half_plus_two").version == 124
        lease = manager.acquire("half_plus_two", 124)
        executor = lease.servable
        try:
            sig = executor.model.signatures["serving_default"]
            feed = {sig.inputs["x"].name: np.array([[1], [2], [5]], np.float32)}
            (y,) = executor.run(feed, [sig.outputs["y"].name])
        finally:
            manager.release(lease)
        np.testing.assert_array_equal(y, [[2.5], [3.0], [4.5]])
    finally:
        manager.unload_all()
    # unload_all ran close(): the session is gone.
    with pytest.raises(RuntimeError, match="closed Session"):
        executor.model.session.run("y:0", {"x:0": np.array([[1]], np.float32)})


def test_failed_reload_from_a_new_base_path_ends_and_keeps_the_old_copy_serving(manager, rec, tmp_path):
    # Version 1 serves from old/; the config moves the model to new/, whose version 1 fails to load. The pass
    # must end (it once looped forever), version 1 from old/ keeps serving, and retries stay bounded.
    old_base = model_dir(tmp_path / "old", 1)
    new_base = model_dir(tmp_path / "new", 1)
    manager.apply_config([spec("m", old_base)])
    rec.fail_paths.add(str(new_base / "1"))
    done = []
    worker = threading.Thread(target=lambda: done.append(manager.apply_config([spec("m", new_base)])), daemon=True)
    worker.start()
    worker.join(10)
    assert done, "apply_config did not return: the failed reload is retried forever within one pass"
    assert len(done[0]) == 1 and "version 1 failed to load" in done[0][0]
    assert manager.get("m").path == str(old_base / "1")
    for _ in range(6):
        manager.poll()
    assert rec.attempts("m", 1) == 1 + 3  # the first load from old/, then one load and two retries from new/
    assert manager.get("m").path == str(old_base / "1")

    (new_base / "1" / "saved_model.pb").write_bytes(b"\x08\x01\x12\x04serve, copied completely this time")
    rec.fail_paths.clear()
    assert manager.poll() == []
    assert manager.get("m").path == str(new_base / "1")
    assert closed_versions(rec) == [1]


def test_load_outcomes_reach_the_on_load_hook(rec, tmp_path):
    outcomes = []

    def on_load(name, version, ok, seconds, path):
        outcomes.append((name, version, ok, path))

    manager = ModelManager(rec.make, rec.close, max_num_load_retries=0, on_load=on_load)
    base = model_dir(tmp_path / "m", 1, 2)
    rec.fail_paths.add(str(base / "2"))
    manager.apply_config([spec("m", base)])
    assert outcomes == [("m", 2, False, str(base / "2")), ("m", 1, True, str(base / "1"))]  # the version's folder
    manager.unload_all()
