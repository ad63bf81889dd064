"""The ModelManager: version policies, availability-preserving changes, failed loads, labels, leases."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from executor import GraphExecutor
from loader import LoadError, ModelManager, NotFound, load_saved_model
from loader.config import ModelSpec, VersionPolicy
from loader.errors import Unavailable
from loader.manager import AVAILABLE, END, LOADING
from tests.conftest import TESTDATA

TWO_VERSIONS = TESTDATA / "saved_model_half_plus_two_2_versions"


# -- ModelManager ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Servable:
    name: str
    version: int
    path: str


class Recorder:
    """make_servable / close_servable pair that records, in order, every load attempt and every close.

    ``events`` holds ("make", name, version) for a load that succeeded, ("fail", name, version) for one that
    raised LoadError, and ("close", name, version). Loads fail for the folders in ``fail_paths`` and for every
    folder while ``failing`` is set. ``on_make`` (when set) runs inside each load, before it returns.
    """

    def __init__(self):
        self.events: list[tuple[str, str, int]] = []
        self.made: list[Servable] = []
        self.closed: list[Servable] = []
        self.fail_paths: set[str] = set()
        self.failing = False
        self.on_make = None
        self._lock = threading.Lock()

    def make(self, name: str, version: int, path: str) -> Servable:
        if self.on_make is not None:
            self.on_make(name, version, path)
        if self.failing or path in self.fail_paths:
            with self._lock:
                self.events.append(("fail", name, version))
            raise LoadError(f"cannot load {path}: saved_model.pb is truncated")
        servable = Servable(name, version, path)
        with self._lock:
            self.events.append(("make", name, version))
            self.made.append(servable)
        return servable

    def close(self, servable: Servable) -> None:
        with self._lock:
            self.events.append(("close", servable.name, servable.version))
            self.closed.append(servable)

    def attempts(self, name: str, version: int) -> int:
        return sum(1 for kind, n, v in self.events if kind in ("make", "fail") and (n, v) == (name, version))


def add_version(base: Path, version: int, content: bytes = b"\x08\x01\x12\x04serve") -> Path:
    """A version folder with a small saved_model.pb (folder_fingerprint looks at the files)."""
    folder = base / str(version)
    folder.mkdir(parents=True)
    (folder / "saved_model.pb").write_bytes(content)
    (folder / "variables").mkdir()
    (folder / "variables" / "variables.index").write_bytes(b"index")
    return folder


def model_dir(root: Path, *versions: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for version in versions:
        add_version(root, version)
    return root


def spec(name: str, base: Path, policy: VersionPolicy | None = None, labels: dict[str, int] | None = None):
    return ModelSpec(name, str(base), policy or VersionPolicy(), labels or {})


def available(manager: ModelManager, name: str) -> list[int]:
    return [sv.version for sv in manager.statuses(name) if sv.state == AVAILABLE]


def made_versions(rec: Recorder, name: str = "m") -> list[int]:
    return [s.version for s in rec.made if s.name == name]


def closed_versions(rec: Recorder, name: str = "m") -> list[int]:
    return [s.version for s in rec.closed if s.name == name]


@pytest.fixture
def rec():
    return Recorder()


@pytest.fixture
def manager(rec):
    m = ModelManager(rec.make, rec.close, max_num_load_retries=2, load_retry_interval_s=0)
    yield m
    m.unload_all()


# -- apply_config and version policies ------------------------------------------------------------------


def test_default_policy_serves_only_the_latest_version(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    assert manager.apply_config([spec("m", base)]) == []
    assert available(manager, "m") == [3]
    assert [(s.name, s.version, s.path) for s in rec.made] == [("m", 3, str(base / "3"))]
    served = manager.get("m")
    assert (served.name, served.version, served.path, served.state) == ("m", 3, str(base / "3"), AVAILABLE)
    assert served.servable is rec.made[0]
    assert manager.get("m", 3) is served
    assert [sv.version for sv in manager.statuses("m")] == [3]  # 1 and 2 were never loaded
    assert manager.model_names() == ["m"] and manager.available_models() == ["m"]
    assert manager.is_served("m") and not manager.is_served("other")
    assert rec.closed == []


def test_several_models_each_with_its_policy(manager, rec, tmp_path):
    a = model_dir(tmp_path / "a", 1, 2)
    b = model_dir(tmp_path / "b", 5, 7, 9)
    problems = manager.apply_config([spec("a", a), spec("b", b, VersionPolicy("latest", num_versions=2))])
    assert problems == []
    assert manager.model_names() == ["a", "b"]
    assert manager.available_models() == ["a", "b"]
    assert available(manager, "a") == [2]
    assert available(manager, "b") == [7, 9]
    assert manager.get("a").path == str(a / "2")
    assert manager.get("b").version == 9
    assert manager.get("b", 7).path == str(b / "7")
    assert sorted((s.name, s.version) for s in rec.made) == [("a", 2), ("b", 7), ("b", 9)]


def test_latest_two(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    assert manager.apply_config([spec("m", base, VersionPolicy("latest", num_versions=2))]) == []
    assert available(manager, "m") == [2, 3]
    assert sorted(made_versions(rec)) == [2, 3]
    assert manager.get("m").version == 3
    with pytest.raises(NotFound):
        manager.get("m", 1)
    assert rec.closed == []


def test_all_versions(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    assert manager.apply_config([spec("m", base, VersionPolicy("all"))]) == []
    assert available(manager, "m") == [1, 2, 3]
    assert sorted(made_versions(rec)) == [1, 2, 3]
    assert [manager.get("m", v).path for v in (1, 2, 3)] == [str(base / str(v)) for v in (1, 2, 3)]
    assert manager.get("m").version == 3


def test_specific_versions(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    problems = manager.apply_config([spec("m", base, VersionPolicy("specific", versions=frozenset({1, 3})))])
    assert problems == []
    assert available(manager, "m") == [1, 3]
    assert sorted(made_versions(rec)) == [1, 3]
    assert manager.get("m").version == 3
    with pytest.raises(NotFound, match=r"\[1, 3\]"):
        manager.get("m", 2)


def test_specific_version_not_on_disk_serves_the_others(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base, VersionPolicy("specific", versions=frozenset({1, 4})))])
    assert available(manager, "m") == [1]
    add_version(base, 4)
    manager.poll()
    assert available(manager, "m") == [1, 4]
    assert sorted(made_versions(rec)) == [1, 4]


def test_changing_the_policy_unloads_what_it_no_longer_wants(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    manager.apply_config([spec("m", base, VersionPolicy("all"))])
    rec.events.clear()
    assert manager.apply_config([spec("m", base)]) == []
    assert available(manager, "m") == [3]
    assert sorted(rec.events) == [("close", "m", 1), ("close", "m", 2)]  # 3 stays loaded, not made again
    assert manager.get("m").servable is next(s for s in rec.made if s.version == 3)


def test_apply_config_again_with_the_same_specs_changes_nothing(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    served = manager.get("m")
    assert manager.apply_config([spec("m", base)]) == []
    assert manager.get("m") is served
    assert len(rec.made) == 1 and rec.closed == []


# -- changes on disk: availability-preserving, leases -------------------------------------------------------


def test_new_version_serves_before_the_old_one_unloads(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    old = manager.get("m")
    old_servable = old.servable
    assert old.version == 2
    rec.events.clear()
    served_during_load = []
    rec.on_make = lambda name, version, path: served_during_load.append(manager.get("m").version)
    add_version(base, 3)
    assert manager.poll() == []
    assert rec.events == [("make", "m", 3), ("close", "m", 2)]  # made first, then closed
    assert served_during_load == [2]  # requests kept being served by 2 while 3 loaded
    assert manager.get("m").version == 3
    assert manager.get("m").path == str(base / "3")
    assert available(manager, "m") == [3]
    assert rec.closed == [old_servable]
    assert old.state == END and old.servable is None


def test_poll_without_changes_does_nothing(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    rec.events.clear()
    for _ in range(3):
        assert manager.poll() == []
    assert rec.events == []


def test_lease_held_across_a_change_delays_the_close(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    lease = manager.acquire("m")
    assert lease.version == 2
    add_version(base, 3)
    manager.poll()
    assert rec.closed == []  # the in-flight request still runs on 2
    assert lease.servable is not None
    assert manager.get("m").version == 3  # new requests go to 3 already
    with pytest.raises(NotFound):
        manager.acquire("m", 2)  # 2 is out of service
    second = manager.acquire("m")
    assert second.version == 3
    manager.release(lease)
    assert closed_versions(rec) == [2]
    assert lease.servable is None and lease.state == END
    manager.release(second)
    assert closed_versions(rec) == [2]  # 3 stays served after its lease ends


def test_two_leases_close_after_the_last_release(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base)])
    first, second = manager.acquire("m"), manager.acquire("m", 1)
    add_version(base, 2)
    manager.poll()
    manager.release(first)
    assert rec.closed == []
    manager.release(second)
    assert closed_versions(rec) == [1]


def test_removed_version_folder_unloads_on_the_next_poll(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    manager.apply_config([spec("m", base)])
    rec.events.clear()
    shutil.rmtree(base / "3")
    assert manager.poll() == []
    assert rec.events == [("make", "m", 2), ("close", "m", 3)]  # latest is 2 now; 2 serves before 3 goes
    assert manager.get("m").version == 2
    assert [sv.version for sv in manager.statuses("m")] == [2]


def test_removed_version_folder_unloads_under_policy_all(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    manager.apply_config([spec("m", base, VersionPolicy("all"))])
    shutil.rmtree(base / "2")
    manager.poll()
    assert available(manager, "m") == [1, 3]
    assert closed_versions(rec) == [2]
    with pytest.raises(NotFound):
        manager.get("m", 2)


def test_base_path_missing_for_a_moment_keeps_the_served_versions(manager, rec, tmp_path):
    # TensorFlow Serving refuses to emit an empty version list for a missing ("transiently unavailable") base
    # path: the served versions stay. Only a base path that exists and holds no version unloads them.
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    moved = base.rename(tmp_path / "m.moving")
    problems = manager.poll()
    assert len(problems) == 1 and str(base) in problems[0]
    assert manager.get("m").version == 2
    assert rec.closed == []
    moved.rename(base)
    assert manager.poll() == []
    assert manager.get("m").version == 2
    assert len(rec.made) == 1


# -- failed loads -------------------------------------------------------------------------------------------


def test_failed_new_version_keeps_the_old_one_serving(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    rec.fail_paths.add(str(add_version(base, 3)))
    problems = manager.poll()
    assert len(problems) == 1
    assert "'m'" in problems[0] and "version 3" in problems[0]
    assert "saved_model.pb is truncated" in problems[0] and str(base / "3") in problems[0]
    (failed,) = manager.statuses("m", 3)
    assert failed.state == END
    assert failed.error is not None and "saved_model.pb is truncated" in failed.error.message
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(2, AVAILABLE), (3, END)]
    assert manager.get("m").version == 2
    assert rec.closed == []
    with pytest.raises(NotFound) as info:
        manager.get("m", 3)
    assert "failed to load" in info.value.message and "saved_model.pb is truncated" in info.value.message
    with pytest.raises(NotFound, match="truncated"):
        manager.acquire("m", 3)


def test_failed_latest_at_start_falls_back_to_the_next_version(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    rec.fail_paths.add(str(base / "3"))
    problems = manager.apply_config([spec("m", base)])
    assert len(problems) == 1
    assert "'m'" in problems[0] and "version 3" in problems[0] and "truncated" in problems[0]
    assert manager.get("m").version == 2
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(2, AVAILABLE), (3, END)]


def test_model_whose_every_version_fails(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1)
    rec.failing = True
    problems = manager.apply_config([spec("m", base)])
    assert problems and "version 1" in problems[0]
    assert manager.available_models() == []
    with pytest.raises(Unavailable, match="'m'"):
        manager.get("m")


def test_a_non_serving_error_from_the_maker_is_a_load_error(manager, tmp_path):
    def make(name, version, path):
        raise ValueError("bad graph")

    m = ModelManager(make, max_num_load_retries=0)
    problems = m.apply_config([spec("m", model_dir(tmp_path / "m", 1))])
    assert problems and "ValueError: bad graph" in problems[0]
    (failed,) = m.statuses("m")
    assert isinstance(failed.error, LoadError) and failed.state == END


def test_retries_are_bounded_then_resume_when_the_files_change(manager, rec, tmp_path):
    # max_num_load_retries=2, load_retry_interval_s=0: one load and two retries.
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    v3 = add_version(base, 3)
    rec.fail_paths.add(str(v3))
    problems = [manager.poll() for _ in range(6)]
    assert rec.attempts("m", 3) == 3
    assert all(len(p) == 1 and "version 3" in p[0] for p in problems[:3])
    assert manager.get("m").version == 2
    for _ in range(3):
        manager.poll()
    assert rec.attempts("m", 3) == 3  # files unchanged: no more tries

    (v3 / "saved_model.pb").write_bytes(b"\x08\x01\x12\x04serve, copied completely this time")
    rec.fail_paths.clear()
    assert manager.poll() == []
    assert rec.attempts("m", 3) == 4
    assert manager.get("m").version == 3
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(3, AVAILABLE)]
    assert closed_versions(rec) == [2]


def test_changed_files_give_a_fresh_set_of_retries(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base)])
    v2 = add_version(base, 2)
    rec.fail_paths.add(str(v2))
    for _ in range(5):
        manager.poll()
    assert rec.attempts("m", 2) == 3
    (v2 / "variables" / "variables.data-00000-of-00001").write_bytes(b"more bytes arrived")
    for _ in range(5):
        manager.poll()
    assert rec.attempts("m", 2) == 6  # one load and two retries again, then nothing
    assert manager.get("m").version == 1


def test_retry_interval_is_respected(rec, tmp_path):
    manager = ModelManager(rec.make, rec.close, max_num_load_retries=5, load_retry_interval_s=3600)
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base)])
    v2 = add_version(base, 2)
    rec.fail_paths.add(str(v2))
    assert len(manager.poll()) == 1
    assert manager.poll() == []
    assert manager.poll() == []
    assert rec.attempts("m", 2) == 1  # the next retry is an hour away
    (v2 / "saved_model.pb").write_bytes(b"rewritten, longer than before")
    manager.poll()
    assert rec.attempts("m", 2) == 2  # changed files do not wait for the interval


def test_failed_version_removed_from_disk_is_forgotten(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base)])
    rec.fail_paths.add(str(add_version(base, 2)))
    manager.poll()
    assert [sv.version for sv in manager.statuses("m")] == [1, 2]
    shutil.rmtree(base / "2")
    assert manager.poll() == []
    assert [sv.version for sv in manager.statuses("m")] == [1]
    assert manager.get("m").version == 1


# -- model removed, base path changed, unload_all -----------------------------------------------------------


def test_model_removed_from_config_unloads_after_in_flight_requests(manager, rec, tmp_path):
    a = model_dir(tmp_path / "a", 1)
    b = model_dir(tmp_path / "b", 1, 2)
    manager.apply_config([spec("a", a), spec("b", b, VersionPolicy("all"))])
    lease = manager.acquire("b", 2)
    assert manager.apply_config([spec("a", a)]) == []
    with pytest.raises(NotFound) as info:
        manager.get("b")
    assert "'b'" in info.value.message and "served models: a" in info.value.message
    with pytest.raises(NotFound):
        manager.acquire("b", 2)
    assert not manager.is_served("b")
    assert manager.model_names() == ["a"]
    assert closed_versions(rec, "b") == [1]  # no request on 1: closed at once
    manager.release(lease)
    assert sorted(closed_versions(rec, "b")) == [1, 2]
    assert closed_versions(rec, "a") == []
    assert manager.get("a").version == 1


def test_model_removed_and_added_back_loads_again(manager, rec, tmp_path):
    a = model_dir(tmp_path / "a", 1)
    manager.apply_config([spec("a", a)])
    manager.apply_config([])
    assert manager.model_names() == [] and closed_versions(rec, "a") == [1]
    assert manager.apply_config([spec("a", a)]) == []
    assert manager.get("a").servable is rec.made[1]


def test_changing_a_models_base_path_is_availability_preserving(manager, rec, tmp_path):
    # Same model, new base path: the new version must serve before the old one unloads, like a new version
    # appearing on disk (TensorFlow Serving keeps serving across such a config change).
    old_base = model_dir(tmp_path / "old", 1)
    new_base = model_dir(tmp_path / "new", 2)
    manager.apply_config([spec("m", old_base)])
    rec.events.clear()
    seen = []

    def probe(name, version, path):
        try:
            seen.append(manager.get("m").version)
        except Unavailable as e:
            seen.append(e.message)

    rec.on_make = probe
    assert manager.apply_config([spec("m", new_base)]) == []
    assert manager.get("m").path == str(new_base / "2")
    assert seen == [1], "requests during the load of the new base path must still be served by version 1"
    assert rec.events == [("make", "m", 2), ("close", "m", 1)]


def test_unload_all_closes_every_servable_once(manager, rec, tmp_path):
    a = model_dir(tmp_path / "a", 1, 2)
    b = model_dir(tmp_path / "b", 5)
    manager.apply_config([spec("a", a, VersionPolicy("all")), spec("b", b)])
    lease = manager.acquire("a", 1)
    manager.unload_all()
    assert manager.model_names() == []
    with pytest.raises(NotFound):
        manager.get("a")
    assert sorted((s.name, s.version) for s in rec.closed) == [("a", 2), ("b", 5)]
    manager.release(lease)
    assert sorted(id(s) for s in rec.closed) == sorted(id(s) for s in rec.made)
    manager.unload_all()
    assert len(rec.closed) == 3


def test_unload_all_during_a_load_leaks_nothing(rec, tmp_path):
    # Shutdown (unload_all) can come while apply_config is still loading (SIGTERM during the initial load).
    # apply_config must not fail, and what it made must end up closed or served, never dropped unclosed.
    manager = ModelManager(rec.make, rec.close)
    a = model_dir(tmp_path / "a", 1)
    b = model_dir(tmp_path / "b", 1)
    loading, go_on = threading.Event(), threading.Event()

    def block_a(name, version, path):
        if name == "a":
            loading.set()
            go_on.wait(5)

    rec.on_make = block_a
    errors = []

    def apply():
        try:
            manager.apply_config([spec("a", a), spec("b", b)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=apply, daemon=True)
    thread.start()
    assert loading.wait(5)
    manager.unload_all()
    go_on.set()
    thread.join(5)
    assert not thread.is_alive()
    assert errors == []
    served = set()
    for name in manager.model_names():
        served |= {id(sv.servable) for sv in manager.statuses(name) if sv.state == AVAILABLE}
    assert {id(s) for s in rec.made} == served | {id(s) for s in rec.closed}
    manager.unload_all()


def test_unload_all_during_the_load_of_one_model_closes_what_it_made(rec, tmp_path):
    # As above with one model (no KeyError): the servable made after unload_all is neither served nor closed.
    manager = ModelManager(rec.make, rec.close)
    base = model_dir(tmp_path / "m", 1)
    loading, go_on = threading.Event(), threading.Event()

    def block(name, version, path):
        loading.set()
        go_on.wait(5)

    rec.on_make = block
    thread = threading.Thread(target=manager.apply_config, args=([spec("m", base)],), daemon=True)
    thread.start()
    assert loading.wait(5)
    manager.unload_all()
    go_on.set()
    thread.join(5)
    assert not thread.is_alive()
    assert len(rec.made) == 1
    if manager.model_names():
        assert manager.get("m").servable is rec.made[0]
    else:
        assert rec.closed == rec.made, "the servable loaded during unload_all was never closed"


# -- version labels -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy", [VersionPolicy("all"), VersionPolicy("specific", versions=frozenset({1, 2}))], ids=["all", "specific"]
)
def test_labels_pick_versions(manager, tmp_path, policy):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    assert manager.apply_config([spec("m", base, policy, {"stable": 1, "canary": 2})]) == []
    assert manager.get("m", label="stable").version == 1
    assert manager.get("m", label="stable").path == str(base / "1")
    assert manager.get("m", label="canary").version == 2
    lease = manager.acquire("m", label="stable")
    assert lease.version == 1
    manager.release(lease)
    assert [sv.version for sv in manager.statuses("m", label="canary")] == [2]


def test_unknown_label_names_the_labels(manager, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 1, "canary": 2})])
    with pytest.raises(NotFound) as info:
        manager.get("m", label="beta")
    assert "'beta'" in info.value.message
    assert "stable=1" in info.value.message and "canary=2" in info.value.message
    with pytest.raises(NotFound, match="'beta'"):
        manager.acquire("m", label="beta")
    with pytest.raises(NotFound, match="'beta'"):
        manager.statuses("m", label="beta")


def test_model_without_labels_says_so(manager, tmp_path):
    manager.apply_config([spec("m", model_dir(tmp_path / "m", 1))])
    with pytest.raises(NotFound, match="labels: none"):
        manager.get("m", label="stable")


def test_label_on_a_version_that_is_not_available(manager, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    problems = manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 1, "next": 5})])
    assert len(problems) == 1
    assert "'m'" in problems[0] and "'next'" in problems[0] and "version 5" in problems[0]
    assert "not available" in problems[0] and "[1, 2]" in problems[0]
    assert manager.get("m", label="stable").version == 1  # the good label still works
    with pytest.raises(NotFound) as info:
        manager.get("m", label="next")
    assert "'next'" in info.value.message and "version 5" in info.value.message
    # The message must read as a sentence: "... label 'next' points to version 5, which is not available ..."
    assert "which is not available" in info.value.message, info.value.message


def test_label_on_a_version_that_appears_later(manager, tmp_path):
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base, VersionPolicy("all"), {"next": 2})])
    add_version(base, 2)
    assert manager.poll() == []
    assert manager.get("m", label="next").version == 2


def test_label_on_a_failed_version_gives_the_load_error(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    rec.fail_paths.add(str(base / "2"))
    problems = manager.apply_config([spec("m", base, VersionPolicy("all"), {"canary": 2})])
    assert any("version 2 failed to load" in p for p in problems)
    assert any("'canary'" in p for p in problems)
    with pytest.raises(NotFound) as info:
        manager.get("m", label="canary")
    assert "'canary'" in info.value.message and "truncated" in info.value.message


# -- lookup errors ------------------------------------------------------------------------------------------


def test_unknown_model_names_the_served_ones(manager, tmp_path):
    manager.apply_config([spec("m", model_dir(tmp_path / "m", 1)), spec("other", model_dir(tmp_path / "o", 1))])
    calls = (
        lambda: manager.get("nope"),
        lambda: manager.get("nope", 1),
        lambda: manager.acquire("nope"),
        lambda: manager.statuses("nope"),
    )
    for call in calls:
        with pytest.raises(NotFound) as info:
            call()
        assert info.value.code == "NOT_FOUND"
        assert "'nope'" in info.value.message and "m, other" in info.value.message


def test_unknown_model_with_nothing_served():
    manager = ModelManager(Recorder().make)
    with pytest.raises(NotFound, match="'x'.*none"):
        manager.get("x")
    assert manager.model_names() == [] and manager.available_models() == []


def test_unknown_version_names_the_available_versions(manager, tmp_path):
    manager.apply_config([spec("m", model_dir(tmp_path / "m", 1, 2), VersionPolicy("all"))])
    for call in (lambda: manager.get("m", 7), lambda: manager.acquire("m", 7)):
        with pytest.raises(NotFound) as info:
            call()
        assert "'m'" in info.value.message and "version 7" in info.value.message
        assert "[1, 2]" in info.value.message
    with pytest.raises(NotFound, match=r"known: \[1, 2\]"):
        manager.statuses("m", 7)


def test_missing_base_path_is_a_problem_and_unavailable(manager, rec, tmp_path):
    base = tmp_path / "not_there"
    problems = manager.apply_config([spec("m", base)])
    assert len(problems) == 1
    assert "'m'" in problems[0] and str(base) in problems[0] and "does not exist" in problems[0]
    assert manager.is_served("m") and manager.model_names() == ["m"]
    assert manager.available_models() == []
    assert manager.statuses("m") == []
    with pytest.raises(Unavailable) as info:
        manager.get("m")
    assert info.value.code == "UNAVAILABLE"
    assert "'m'" in info.value.message and str(base) in info.value.message
    with pytest.raises(Unavailable):
        manager.acquire("m")
    assert rec.events == []
    # The folder arrives: the next poll serves it.
    model_dir(base, 4)
    assert manager.poll() == []
    assert manager.get("m").version == 4


def test_base_path_without_versions_is_a_problem(manager, tmp_path):
    base = model_dir(tmp_path / "m")
    problems = manager.apply_config([spec("m", base)])
    assert len(problems) == 1 and "no version folder" in problems[0]
    with pytest.raises(Unavailable, match="no version folder"):
        manager.get("m")


def test_failed_acquire_leaks_no_lease(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base)])
    with pytest.raises(NotFound):
        manager.acquire("m", 9)
    add_version(base, 2)
    manager.poll()
    assert closed_versions(rec) == [1]  # nothing held version 1


# -- statuses -----------------------------------------------------------------------------------------------


def test_statuses_by_name_version_and_label(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2, 3)
    rec.fail_paths.add(str(base / "3"))
    manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 1})])
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(1, AVAILABLE), (2, AVAILABLE), (3, END)]
    (two,) = manager.statuses("m", 2)
    assert (two.version, two.state, two.error) == (2, AVAILABLE, None)
    (three,) = manager.statuses("m", 3)
    assert three.state == END and "truncated" in three.error.message
    (stable,) = manager.statuses("m", label="stable")
    assert stable.version == 1 and stable is manager.get("m", 1)


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
    manager = ModelManager(rec.make, rec.close, max_num_load_retries=0, on_load=lambda *a: outcomes.append(a[:3]))
    base = model_dir(tmp_path / "m", 1, 2)
    rec.fail_paths.add(str(base / "2"))
    manager.apply_config([spec("m", base)])
    assert outcomes == [("m", 2, False), ("m", 1, True)]
    manager.unload_all()
