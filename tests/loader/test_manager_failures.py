"""The ModelManager: failed loads and their retries, models removed or moved, unload_all."""

from __future__ import annotations

import shutil
import threading

import pytest

from servex.loader import LoadError, ModelManager, NotFound
from servex.loader.config import VersionPolicy
from servex.loader.errors import Unavailable
from servex.loader.manager import AVAILABLE, END
from tests.loader.manager_fakes import Recorder, add_version, closed_versions, model_dir, spec

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
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(2, END), (3, AVAILABLE)]  # 2 unloaded
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


def unload_all_during_load(manager: ModelManager, rec: Recorder, specs: list, blocked: str) -> list[Exception]:
    """apply_config(specs) on a thread, unload_all while model ``blocked`` is loading; what apply_config raised."""
    loading, go_on = threading.Event(), threading.Event()

    def block(name, version, path):
        if name == blocked:
            loading.set()
            go_on.wait(5)

    rec.on_make = block
    errors = []

    def apply():
        try:
            manager.apply_config(specs)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=apply, daemon=True)
    thread.start()
    assert loading.wait(5)
    manager.unload_all()
    go_on.set()
    thread.join(5)
    assert not thread.is_alive()
    return errors


def test_unload_all_during_a_load_leaks_nothing(rec, tmp_path):
    # Shutdown (unload_all) can come while apply_config is still loading (SIGTERM during the initial load).
    # apply_config must not fail, and what it made must end up closed or served, never dropped unclosed.
    manager = ModelManager(rec.make, rec.close)
    specs = [spec("a", model_dir(tmp_path / "a", 1)), spec("b", model_dir(tmp_path / "b", 1))]
    assert unload_all_during_load(manager, rec, specs, blocked="a") == []
    served = set()
    for name in manager.model_names():
        served |= {id(sv.servable) for sv in manager.statuses(name) if sv.state == AVAILABLE}
    assert {id(s) for s in rec.made} == served | {id(s) for s in rec.closed}
    manager.unload_all()


def test_unload_all_during_the_load_of_one_model_closes_what_it_made(rec, tmp_path):
    # As above with one model (no KeyError): the servable made after unload_all is neither served nor closed.
    manager = ModelManager(rec.make, rec.close)
    assert unload_all_during_load(manager, rec, [spec("m", model_dir(tmp_path / "m", 1))], blocked="m") == []
    assert len(rec.made) == 1
    if manager.model_names():
        assert manager.get("m").servable is rec.made[0]
    else:
        assert rec.closed == rec.made, "the servable loaded during unload_all was never closed"
