"""The ModelManager: version policies, and availability-preserving changes on disk under leases."""

from __future__ import annotations

import shutil

import pytest

from servex.loader import NotFound
from servex.loader.config import VersionPolicy
from servex.loader.manager import AVAILABLE, END
from tests.loader.manager_fakes import (
    add_version,
    available,
    closed_versions,
    made_versions,
    model_dir,
    spec,
)

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
    problems = manager.apply_config([spec("m", base, VersionPolicy("specific", versions=frozenset({1, 4})))])
    assert problems == [
        f"model 'm': version(s) [4] of its specific version policy are not under base path {str(base)!r} "
        f"(version folders there: [1, 2])"
    ]  # said, so that a reload naming a version that is not there does not look like success
    assert available(manager, "m") == [1]
    add_version(base, 4)
    assert manager.poll() == []
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
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(2, AVAILABLE), (3, END)]  # as TF Serving
    assert manager.statuses("m", 3)[0].state == END and manager.statuses("m", 3)[0].error is None


def test_an_unloaded_version_stays_in_the_status_as_end_until_it_loads_again(manager, rec, tmp_path):
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base)])
    shutil.rmtree(base / "2")
    manager.poll()
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(1, AVAILABLE), (2, END)]
    with pytest.raises(NotFound, match="has no version 2"):
        manager.get("m", 2)  # END is for the status; requests get NOT_FOUND
    add_version(base, 2)
    manager.poll()
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(1, END), (2, AVAILABLE)]
    assert manager.get("m", 2).servable is rec.made[-1]


def test_the_status_keeps_the_last_max_ended_unloaded_versions(manager, tmp_path, monkeypatch):
    from servex.loader import manager as manager_module

    monkeypatch.setattr(manager_module, "MAX_ENDED", 3)
    base = model_dir(tmp_path / "m", 1)
    manager.apply_config([spec("m", base)])
    for version in range(2, 7):  # each new version unloads the one before
        add_version(base, version)
        manager.poll()
    assert [(sv.version, sv.state) for sv in manager.statuses("m")] == [(3, END), (4, END), (5, END), (6, AVAILABLE)]


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
