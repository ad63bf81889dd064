"""Reading a Triton model repository (loader/model_repository.py): its layout and config.pbtxt into ModelSpecs, and
what servex refuses with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from servex.loader.config import VersionPolicy
from servex.loader.errors import InvalidArgument
from servex.loader.model_repository import read_model, read_repositories


def model(root: Path, name: str, config: str | None = None, versions=(1,)) -> Path:
    folder = root / name
    for version in versions:
        (folder / str(version) / "model.savedmodel").mkdir(parents=True)
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    return folder


def test_a_folder_without_config_is_a_savedmodel_served_latest_one(tmp_path):
    folder = model(tmp_path, "plain")
    spec, notes = read_model("plain", str(folder))
    assert (spec.name, spec.base_path, spec.model_file) == ("plain", str(folder), "model.savedmodel")
    assert spec.policy == VersionPolicy("latest", num_versions=1)
    assert spec.triton_config is not None and spec.triton_config.max_batch_size == 0
    assert notes == []


def test_config_fields_servex_uses(tmp_path):
    folder = model(
        tmp_path,
        "m",
        """
        name: "m"
        platform: "tensorflow_savedmodel"
        default_model_filename: "exported"
        version_policy: { specific { versions: [1, 3] } }
        max_batch_size: 16
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 500 }
        """,
    )
    spec, notes = read_model("m", str(folder))
    assert spec.model_file == "exported"
    assert spec.policy == VersionPolicy("specific", versions=frozenset({1, 3}))
    config = spec.triton_config
    assert config.max_batch_size == 16 and config.HasField("dynamic_batching")
    assert [i.name for i in config.input] == ["x"]
    assert notes == []


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("latest { num_versions: 2 }", VersionPolicy("latest", num_versions=2)),
        ("all {}", VersionPolicy("all")),
    ],
)
def test_version_policies(tmp_path, policy, expected):
    folder = model(tmp_path, "m", f"version_policy {{ {policy} }}")
    assert read_model("m", str(folder))[0].policy == expected


def test_settings_that_change_nothing_are_noted_by_name(tmp_path):
    folder = model(
        tmp_path,
        "m",
        """
        instance_group [ { count: 2 kind: KIND_CPU } ]
        optimization { priority: PRIORITY_MAX }
        parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "serving_default" } }
        parameters { key: "SOMETHING" value: { string_value: "x" } }
        """,
    )
    _, notes = read_model("m", str(folder))
    assert any("instance_group, optimization" in note for note in notes), notes
    assert any("SOMETHING" in note and "TF_SIGNATURE_DEF" not in note for note in notes), notes


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ('platform: "onnxruntime_onnx"', ["platform 'onnxruntime_onnx'", "TensorFlow SavedModels"]),
        ('backend: "python"', ["backend 'python'"]),
        ('platform: "tensorflow_graphdef"', ["platform 'tensorflow_graphdef'"]),
        ('name: "other"', ["names model 'other'", "folder is 'm'"]),
        ("max_batch_sise: 8", ["not a Triton ModelConfig", "max_batch_sise"]),
        ("max_batch_size: -1", ["max_batch_size must be 0 or more"]),
        ("dynamic_batching {}", ["dynamic_batching needs max_batch_size > 0"]),
        ("max_batch_size: 4 sequence_batching {}", ["sequence_batching", "stateful"]),
        ("ensemble_scheduling { step [] }", ["ensemble_scheduling", "ensembles"]),
        ("version_policy { specific {} }", ["specific lists no versions"]),
        ("version_policy { latest {} }", ["num_versions must be at least 1"]),
        ('default_model_filename: "a/b"', ["default_model_filename 'a/b'"]),
        (
            'parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "predict" } }',
            ["TF_SIGNATURE_DEF 'predict' is not supported", "'serving_default'"],
        ),
        ('parameters { key: "TF_GRAPH_TAG" value: { string_value: "gpu" } }', ["TF_GRAPH_TAG 'gpu'", "'serve'"]),
    ],
)
def test_what_cannot_be_served_is_refused_with_the_reason(tmp_path, config, words):
    folder = model(tmp_path, "m", config)
    with pytest.raises(InvalidArgument) as e:
        read_model("m", str(folder))
    assert "model 'm'" in e.value.message and "config.pbtxt" in e.value.message
    for word in words:
        assert word in e.value.message


def test_a_repository_reads_every_model_and_sets_aside_those_it_cannot_serve(tmp_path):
    model(tmp_path, "a")
    model(tmp_path, "b", 'platform: "tensorflow_savedmodel" max_batch_size: 8')
    model(tmp_path, "onnx", 'platform: "onnxruntime_onnx"')
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README.md").write_text("not a model")
    repository = read_repositories([str(tmp_path)])
    assert [spec.name for spec in repository.specs] == ["a", "b"]
    assert list(repository.refused) == ["onnx"] and "onnxruntime_onnx" in repository.refused["onnx"]


def test_a_model_in_two_repositories_is_refused_in_both(tmp_path):
    first, second = tmp_path / "one", tmp_path / "two"
    model(first, "same")
    model(first, "only_here")
    model(second, "same")
    repository = read_repositories([str(first), str(second)])
    assert [spec.name for spec in repository.specs] == ["only_here"]
    assert str(first) in repository.refused["same"] and str(second) in repository.refused["same"]


def test_a_missing_repository_is_an_error_naming_it(tmp_path):
    with pytest.raises(InvalidArgument, match="model repository .*nowhere.* does not exist"):
        read_repositories([str(tmp_path / "nowhere")])
