"""Numbered version folders under a model's base path, and the ModelManager that serves them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from executor import GraphExecutor
from loader import LoadError, ModelManager, NotFound, latest_version, list_versions, load_saved_model
from tests.conftest import TESTDATA

TWO_VERSIONS = TESTDATA / "saved_model_half_plus_two_2_versions"


def make_base(root: Path, *entries: str, files: tuple[str, ...] = ()) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in entries:
        (root / name).mkdir()
    for name in files:
        (root / name).write_text("not a version")
    return root


# -- list_versions / latest_version ------------------------------------------------------------------------


def test_numbered_folders_only(tmp_path):
    base = make_base(tmp_path / "m", "1", "2", "0007", "abc", "1a", "v3", ".4", "-5", files=("99", "100.txt"))
    assert list_versions(str(base)) == {
        1: os.path.join(str(base), "1"),
        2: os.path.join(str(base), "2"),
        7: os.path.join(str(base), "0007"),
    }


def test_highest_version_wins_numerically(tmp_path):
    base = make_base(tmp_path / "m", "2", "10", "9")
    assert latest_version(str(base)) == (10, os.path.join(str(base), "10"))


def test_numbered_file_is_not_a_version(tmp_path):
    base = make_base(tmp_path / "m", "3", files=("50",))
    assert latest_version(str(base)) == (3, os.path.join(str(base), "3"))


def test_reference_model_with_two_versions(testdata):
    versions = list_versions(str(TWO_VERSIONS))
    assert sorted(versions) == [123, 124]
    assert versions[123] == os.path.join(str(TWO_VERSIONS), "00000123")
    assert latest_version(str(TWO_VERSIONS)) == (124, os.path.join(str(TWO_VERSIONS), "00000124"))


def test_missing_base_path(tmp_path):
    base = tmp_path / "no_such_model"
    with pytest.raises(LoadError) as info:
        list_versions(str(base))
    assert str(base) in info.value.message
    assert "does not exist" in info.value.message
    with pytest.raises(LoadError, match="no_such_model"):
        latest_version(str(base))


def test_empty_base_path(tmp_path):
    base = make_base(tmp_path / "empty")
    with pytest.raises(LoadError) as info:
        latest_version(str(base))
    assert str(base) in info.value.message
    assert "no version folder" in info.value.message


def test_base_path_without_numbered_folder_lists_what_it_found(tmp_path):
    base = make_base(tmp_path / "m", "latest", files=("7",))
    with pytest.raises(LoadError) as info:
        list_versions(str(base))
    assert str(base) in info.value.message
    assert "'latest'" in info.value.message and "'7'" in info.value.message


def test_non_ascii_digit_folder_is_ignored(tmp_path):
    # '²'.isdigit() is True but it is no version number; TensorFlow Serving parses ASCII digits only.
    base = make_base(tmp_path / "m", "1", "²")
    assert list_versions(str(base)) == {1: os.path.join(str(base), "1")}


def test_arabic_indic_digits_are_not_a_version(tmp_path):
    # int('١٢') == 12: such a folder must not be served as version 12 (nor shadow a real '12').
    base = make_base(tmp_path / "m", "3", "١٢")
    assert latest_version(str(base)) == (3, os.path.join(str(base), "3"))


# -- ModelManager ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Servable:
    name: str
    version: int
    path: str


class Recorder:
    """make_servable / close_servable pair that records what the manager asks for."""

    def __init__(self):
        self.made: list[Servable] = []
        self.closed: list[Servable] = []

    def make(self, name: str, version: int, path: str) -> Servable:
        servable = Servable(name, version, path)
        self.made.append(servable)
        return servable

    def close(self, servable: Servable) -> None:
        self.closed.append(servable)


@pytest.fixture
def two_models(tmp_path):
    """Model 'm' served at versions 1 and 2 (two base paths), model 'other' at version 5."""
    rec = Recorder()
    manager = ModelManager(rec.make, rec.close)
    manager.load_latest("m", str(make_base(tmp_path / "a", "1")))
    manager.load_latest("m", str(make_base(tmp_path / "b", "1", "2")))
    manager.load_latest("other", str(make_base(tmp_path / "c", "5", "not_a_version")))
    return manager, rec, tmp_path


def test_load_latest_makes_the_highest_version(tmp_path):
    rec = Recorder()
    manager = ModelManager(rec.make, rec.close)
    base = make_base(tmp_path / "m", "2", "10")
    served = manager.load_latest("m", str(base))
    assert (served.name, served.version, served.path) == ("m", 10, os.path.join(str(base), "10"))
    assert served.state == "AVAILABLE"
    assert [(s.name, s.version, s.path) for s in rec.made] == [("m", 10, os.path.join(str(base), "10"))]
    assert served.servable is rec.made[0]
    assert manager.get("m") is served


def test_get_by_name_and_version(two_models):
    manager, rec, tmp_path = two_models
    assert manager.get("m").version == 2
    assert manager.get("m").path == os.path.join(str(tmp_path / "b"), "2")
    assert manager.get("m", 1).version == 1
    assert manager.get("m", 1).path == os.path.join(str(tmp_path / "a"), "1")
    assert manager.get("m", 2) is manager.get("m")
    assert manager.get("other").servable is rec.made[2]
    assert manager.model_names() == ["m", "other"]


def test_versions_lowest_first(two_models):
    manager, _, _ = two_models
    assert [v.version for v in manager.versions("m")] == [1, 2]
    assert [v.version for v in manager.versions("other")] == [5]


def test_unknown_model_names_the_model_and_the_served_ones(two_models):
    manager, _, _ = two_models
    for call in (lambda: manager.get("nope"), lambda: manager.get("nope", 1), lambda: manager.versions("nope")):
        with pytest.raises(NotFound) as info:
            call()
        assert info.value.code == "NOT_FOUND"
        assert "'nope'" in info.value.message
        assert "m, other" in info.value.message


def test_unknown_model_with_nothing_served():
    manager = ModelManager(Recorder().make)
    with pytest.raises(NotFound, match="'x'.*none"):
        manager.get("x")


def test_unknown_version_names_the_available_versions(two_models):
    manager, _, _ = two_models
    with pytest.raises(NotFound) as info:
        manager.get("m", 3)
    assert "'m'" in info.value.message
    assert "3" in info.value.message
    assert "[1, 2]" in info.value.message


def test_unload_all_closes_every_servable(two_models):
    manager, rec, _ = two_models
    assert rec.closed == []
    manager.unload_all()
    assert sorted(id(s) for s in rec.closed) == sorted(id(s) for s in rec.made)
    assert len(rec.closed) == 3
    assert manager.model_names() == []
    with pytest.raises(NotFound):
        manager.get("m")
    manager.unload_all()  # nothing left: closes nothing twice
    assert len(rec.closed) == 3


def test_reloading_a_served_version_closes_the_one_it_replaces(tmp_path):
    # Loading the same version again must not drop the earlier servable (its session) unclosed.
    rec = Recorder()
    manager = ModelManager(rec.make, rec.close)
    base = str(make_base(tmp_path / "m", "4"))
    manager.load_latest("m", base)
    manager.load_latest("m", base)
    assert manager.get("m").servable is rec.made[1]
    manager.unload_all()
    assert sorted(id(s) for s in rec.closed) == sorted(id(s) for s in rec.made)


def test_load_failure_serves_nothing(tmp_path):
    rec = Recorder()
    manager = ModelManager(rec.make, rec.close)
    with pytest.raises(LoadError, match="missing"):
        manager.load_latest("m", str(tmp_path / "missing"))
    assert rec.made == []

    def broken(name, version, path):
        raise LoadError(f"cannot load {path}")

    manager = ModelManager(broken)
    with pytest.raises(LoadError, match="cannot load"):
        manager.load_latest("m", str(make_base(tmp_path / "m", "1")))
    assert manager.model_names() == []


def test_manager_serves_the_latest_reference_model(testdata):
    def make(name, version, path):
        return GraphExecutor(load_saved_model(path))

    manager = ModelManager(make, lambda executor: executor.close())
    served = manager.load_latest("half_plus_two", str(TWO_VERSIONS))
    try:
        assert served.version == 124
        executor = manager.get("half_plus_two", 124).servable
        sig = executor.model.signatures["serving_default"]
        (y,) = executor.run({sig.inputs["x"].name: np.array([[1], [2], [5]], np.float32)}, [sig.outputs["y"].name])
        np.testing.assert_array_equal(y, [[2.5], [3.0], [4.5]])
    finally:
        manager.unload_all()
    # unload_all ran close(): the session is gone.
    with pytest.raises(RuntimeError, match="closed Session"):
        executor.model.session.run("y:0", {"x:0": np.array([[1]], np.float32)})
