"""Version folders under a model's base path: numbered folders only, the highest wins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from servex.loader import LoadError, latest_version, list_versions
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


def test_a_number_past_int64_is_not_a_version(tmp_path):
    # TensorFlow Serving parses version folders as int64 (safe_strto64) and skips the rest; such a folder served as
    # the latest version would fail every call that reports its version.
    base = make_base(tmp_path / "m", "3", str(2**63 - 1), str(2**63), "99999999999999999999")
    assert list_versions(str(base)) == {
        3: os.path.join(str(base), "3"),
        2**63 - 1: os.path.join(str(base), str(2**63 - 1)),
    }
