"""Model config files in TensorFlow Serving's text format, and the version policies they set."""

from __future__ import annotations

import pytest

from servex.loader.config import ModelSpec, VersionPolicy, parse_model_config, read_model_config_file
from servex.loader.errors import InvalidArgument
from tests.conftest import EXPECTED

GOOD = EXPECTED / "good_model_config.txt"
BAD = EXPECTED / "bad_model_config.txt"


def one_model(body: str) -> str:
    return f"model_config_list {{ config {{ name: 'm' base_path: '/models/m' {body} }} }}"


def invalid(text: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_model_config(text, "test config")
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.message.startswith("test config")
    return info.value.message


# -- TensorFlow Serving's own config files ------------------------------------------------------------------


def test_good_model_config_with_its_variables(testdata, monkeypatch):
    monkeypatch.setenv("TEST_HALF_PLUS_TWO_DIR", "/models/half_plus_two")
    monkeypatch.setenv("TEST_HALF_PLUS_THREE_DIR", "/models/half_plus_three")
    specs = parse_model_config(GOOD.read_text(), "good")
    assert specs == [
        ModelSpec("half_plus_two", "/models/half_plus_two", VersionPolicy("latest", 1), {}),
        ModelSpec("half_plus_three", "/models/half_plus_three", VersionPolicy("latest", 1), {}),
    ]
    assert read_model_config_file(str(GOOD)) == specs


def test_good_model_config_without_its_variables(testdata, monkeypatch):
    monkeypatch.delenv("TEST_HALF_PLUS_TWO_DIR", raising=False)
    monkeypatch.delenv("TEST_HALF_PLUS_THREE_DIR", raising=False)
    with pytest.raises(InvalidArgument) as info:
        read_model_config_file(str(GOOD))
    message = info.value.message
    assert "TEST_HALF_PLUS_TWO_DIR" in message and "TEST_HALF_PLUS_THREE_DIR" in message
    assert "not set" in message and str(GOOD) in message


def test_only_the_missing_variable_is_named(testdata, monkeypatch):
    monkeypatch.setenv("TEST_HALF_PLUS_TWO_DIR", "/models/half_plus_two")
    monkeypatch.delenv("TEST_HALF_PLUS_THREE_DIR", raising=False)
    message = invalid(GOOD.read_text())
    assert "TEST_HALF_PLUS_THREE_DIR" in message and "TEST_HALF_PLUS_TWO_DIR" not in message


def test_bad_model_config_is_not_text_format(testdata):
    with pytest.raises(InvalidArgument) as info:
        read_model_config_file(str(BAD))
    assert "text format" in info.value.message
    assert str(BAD) in info.value.message


def test_missing_config_file_names_the_path(tmp_path):
    path = tmp_path / "no_such_config.txt"
    with pytest.raises(InvalidArgument) as info:
        read_model_config_file(str(path))
    assert str(path) in info.value.message
    assert "cannot read" in info.value.message


def test_empty_config_serves_nothing():
    assert parse_model_config("") == []
    assert parse_model_config("model_config_list {}") == []


# -- policies and labels ------------------------------------------------------------------------------------


def test_default_policy_is_latest_one():
    (spec,) = parse_model_config(one_model(""))
    assert spec == ModelSpec("m", "/models/m", VersionPolicy("latest", 1), {})
    assert spec.policy.describe() == "latest 1"


def test_latest_two():
    (spec,) = parse_model_config(one_model("model_version_policy { latest { num_versions: 2 } }"))
    assert (spec.policy.kind, spec.policy.num_versions) == ("latest", 2)
    assert spec.policy.describe() == "latest 2"


def test_all():
    (spec,) = parse_model_config(one_model("model_version_policy { all {} }"))
    assert spec.policy.kind == "all"
    assert spec.policy.describe() == "all"


def test_specific_versions():
    (spec,) = parse_model_config(one_model("model_version_policy { specific { versions: 1 versions: 3 } }"))
    assert spec.policy.kind == "specific"
    assert spec.policy.versions == frozenset({1, 3})
    assert spec.policy.describe() == "specific [1, 3]"


def test_version_labels():
    text = one_model(
        "model_version_policy { specific { versions: 1 versions: 2 } } "
        "version_labels { key: 'stable' value: 1 } version_labels { key: 'canary' value: 2 }"
    )
    (spec,) = parse_model_config(text)
    assert spec.labels == {"stable": 1, "canary": 2}


def test_labels_with_policy_all_may_name_any_version():
    text = one_model("model_version_policy { all {} } version_labels { key: 'stable' value: 42 }")
    (spec,) = parse_model_config(text)
    assert spec.labels == {"stable": 42}


def test_model_platform_tensorflow_is_accepted():
    (spec,) = parse_model_config(one_model("model_platform: 'tensorflow'"))
    assert spec.name == "m"


def test_several_models_keep_their_order():
    text = (
        "model_config_list { config { name: 'b' base_path: '/b' } config { name: 'a' base_path: '/a' "
        "model_version_policy { all {} } } }"
    )
    specs = parse_model_config(text)
    assert [(s.name, s.base_path, s.policy.kind) for s in specs] == [("b", "/b", "latest"), ("a", "/a", "all")]


def test_variables_expand_anywhere_in_the_file(monkeypatch):
    monkeypatch.setenv("MODEL_ROOT", "/srv/models")
    (spec,) = parse_model_config("model_config_list { config { name: 'm' base_path: '${MODEL_ROOT}/m' } }")
    assert spec.base_path == "/srv/models/m"


# -- what is refused ----------------------------------------------------------------------------------------


def test_duplicate_model_names():
    message = invalid("model_config_list { config { name: 'm' base_path: '/a' } config { name: 'm' base_path: '/b' } }")
    assert "'m'" in message and "twice" in message and "config[1]" in message


def test_empty_name():
    message = invalid("model_config_list { config { base_path: '/a' } }")
    assert "name is empty" in message and "config[0]" in message


def test_empty_base_path():
    message = invalid("model_config_list { config { name: 'm' } }")
    assert "base_path is empty" in message and "'m'" in message


def test_latest_without_num_versions_means_one():
    # proto3 cannot tell `latest {}` from `latest { num_versions: 0 }`; TensorFlow Serving serves
    # max(num_versions, 1) versions (file_system_storage_path_source.cc, AspireLatestVersions), so a config it
    # accepts must not be refused here.
    for body in ("latest {}", "latest { num_versions: 0 }"):
        (spec,) = parse_model_config(one_model(f"model_version_policy {{ {body} }}"))
        assert spec.policy == VersionPolicy("latest", num_versions=1)


def test_specific_without_versions():
    message = invalid(one_model("model_version_policy { specific {} }"))
    assert "specific" in message and "no versions" in message


def test_label_outside_the_specific_versions():
    message = invalid(
        one_model("model_version_policy { specific { versions: 1 } } version_labels { key: 'canary' value: 2 }")
    )
    assert "canary" in message and "specific" in message


def test_other_model_platform():
    message = invalid(one_model("model_platform: 'pytorch'"))
    assert "'pytorch'" in message and "tensorflow" in message


def test_custom_model_config():
    message = invalid("custom_model_config { type_url: 'type.googleapis.com/x.Y' value: '' }")
    assert "custom_model_config" in message and "model_config_list" in message


def test_unknown_field_is_a_text_format_error():
    message = invalid(one_model("no_such_field: 1"))
    assert "text format" in message and "no_such_field" in message


# -- VersionPolicy.select -----------------------------------------------------------------------------------


def test_select_latest():
    assert VersionPolicy().select([1, 10, 2]) == [10]
    assert VersionPolicy("latest", num_versions=2).select([3, 1, 10, 2]) == [10, 3]
    assert VersionPolicy("latest", num_versions=5).select([2, 1]) == [2, 1]
    assert VersionPolicy().select([]) == []


def test_select_all():
    assert VersionPolicy("all").select([2, 10, 1]) == [10, 2, 1]
    assert VersionPolicy("all").select([]) == []


def test_select_specific():
    policy = VersionPolicy("specific", versions=frozenset({1, 3, 7}))
    assert policy.select([1, 2, 3, 4]) == [3, 1]
    assert policy.select([2, 4]) == []
    assert policy.select([7]) == [7]
