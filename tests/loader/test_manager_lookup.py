"""The ModelManager: version labels, lookup errors that name what is served, statuses."""

from __future__ import annotations

import pytest

from servex.loader import ModelManager, NotFound
from servex.loader.config import VersionPolicy
from servex.loader.errors import FailedPrecondition, InvalidArgument, Unavailable
from servex.loader.manager import AVAILABLE, END
from tests.loader.manager_fakes import (
    Recorder,
    add_version,
    closed_versions,
    model_dir,
    spec,
)

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
    # INVALID_ARGUMENT, as TensorFlow Serving's "Unrecognized servable version label"
    base = model_dir(tmp_path / "m", 1, 2)
    manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 1, "canary": 2})])
    with pytest.raises(InvalidArgument) as info:
        manager.get("m", label="beta")
    assert "'beta'" in info.value.message
    assert "stable=1" in info.value.message and "canary=2" in info.value.message
    with pytest.raises(InvalidArgument, match="'beta'"):
        manager.acquire("m", label="beta")
    with pytest.raises(InvalidArgument, match="'beta'"):
        manager.statuses("m", label="beta")


def test_model_without_labels_says_so(manager, tmp_path):
    manager.apply_config([spec("m", model_dir(tmp_path / "m", 1))])
    with pytest.raises(InvalidArgument, match="labels: none"):
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


def test_moving_a_label_to_a_version_that_is_not_available_is_refused_whole(manager, rec, tmp_path):
    """As TensorFlow Serving refuses it ("Request to assign label to version N of model M, which is not currently
    available for inference"): nothing of the config applies, so clients calling by the label keep their version
    and a model the config drops stays."""
    base, other = model_dir(tmp_path / "m", 1, 2), model_dir(tmp_path / "o", 1)
    manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 1}), spec("o", other)])
    with pytest.raises(FailedPrecondition) as info:
        manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 3, "canary": 7})])
    assert info.value.message.startswith(
        "Request to assign label to version 3 of model m, which is not currently available for inference; the "
        "config is not applied: label 'stable' would move from version 1 to version 3 (available versions: [1, 2])"
    )
    assert manager.get("m", label="stable").version == 1 and manager.model_names() == ["m", "o"]
    assert manager.spec("m").labels == {"stable": 1}
    # Moving it to an available version, or adding a new label on a version to come, is taken.
    assert manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 2})]) == []
    assert manager.get("m", label="stable").version == 2 and manager.model_names() == ["m"]
    problems = manager.apply_config([spec("m", base, VersionPolicy("all"), {"stable": 2, "next": 3})])
    assert len(problems) == 1 and "'next' points to version 3, which is not available" in problems[0]
