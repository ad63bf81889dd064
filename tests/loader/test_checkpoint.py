"""Which graph variable is which checkpoint entry, for TF1 and TF2 SavedModels, and the data-size check."""

from __future__ import annotations

import shutil

import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from servex.loader.checkpoint import Checkpoint, slice_shape, variable_checkpoint_entries
from servex.loader.errors import LoadError
from tests.conftest import COUNTER, HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2


def meta_graph(path):
    return saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes()).meta_graphs[0]


@pytest.mark.parametrize(
    "path, expected",
    [
        (HALF_PLUS_TWO_TF1 / "00000123", {"a": "a", "a2": "a2", "b": "b", "c": "c", "c2": "c2"}),
        (HALF_PLUS_TWO_TF2 / "00000123", {v: f"{v}/.ATTRIBUTES/VARIABLE_VALUE" for v in "abc"}),
        (COUNTER / "00000123", {"counter": "counter"}),
    ],
    ids=["tf1", "tf2", "counter"],
)
def test_variable_keys(path, expected):
    entries = variable_checkpoint_entries(meta_graph(path))
    assert {variable for variable, (_, spec) in entries.items() if spec} == set()  # whole tensors, no slices
    keys = {variable: key for variable, (key, _) in entries.items()}
    assert keys == expected
    checkpoint = Checkpoint(str(path))
    assert set(keys.values()) <= set(checkpoint.entries)
    reader = tf.train.load_checkpoint(checkpoint.prefix)
    for key in keys.values():
        entry = checkpoint.entries[key]
        value = reader.get_tensor(key)
        assert value.dtype == entry.dtype and value.shape == entry.shape


def test_truncated_data_fails_at_open(tmp_path):
    version = tmp_path / "1"
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", version)
    data = next((version / "variables").glob("variables.data-*"))
    data.write_bytes(data.read_bytes()[:5])
    with pytest.raises(LoadError) as info:
        Checkpoint(str(version))
    assert "truncated" in info.value.message and data.name in info.value.message


def test_missing_index_fails_at_open(tmp_path):
    version = tmp_path / "1"
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", version)
    (version / "variables" / "variables.index").unlink()
    with pytest.raises(LoadError, match="no checkpoint index"):
        Checkpoint(str(version))


def test_slice_specs():
    assert slice_shape("10 4 0,5:0,4", "here") == (5, 4)
    assert slice_shape("10 4 5,5:-", "here") == (5, 4)
    assert slice_shape("7 0,3", "here") == (3,)
    for bad in ("10 4 0,5", "10 4 0,x:0,4", "nonsense"):
        with pytest.raises(LoadError, match=f"here: slice spec {bad!r} is not understood"):
            slice_shape(bad, "here")
