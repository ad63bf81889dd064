"""loader.load_saved_model on TensorFlow Serving's test SavedModels and on SavedModels exported here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from servex.executor import GraphExecutor
from servex.loader import LoadError, ServingError, load_saved_model
from servex.loader.saved_model import _runs_nothing
from tests.conftest import BAD_HALF_PLUS_TWO, HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2

TF1_PATH = HALF_PLUS_TWO_TF1 / "00000123"
TF2_PATH = HALF_PLUS_TWO_TF2 / "00000123"
TF1_SIGNATURES = {"serving_default", "classify_x_to_y", "regress_x_to_y", "regress_x_to_y2", "regress_x2_to_y3"}


@pytest.fixture(scope="module")
def tf1(testdata):
    model = load_saved_model(str(TF1_PATH))
    yield model
    model.close()


@pytest.fixture(scope="module")
def tf2(testdata):
    model = load_saved_model(str(TF2_PATH))
    yield model
    model.close()


def writable_copy(src: Path, dst: Path) -> Path:
    """Copy a (read-only) test SavedModel so that the test may damage the copy."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for root, _dirs, files in os.walk(dst):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return dst


def export_tf1(path: Path, build) -> Path:
    """Export a TF1 SavedModel (tag serve) whose signature map ``build()`` makes inside a fresh graph."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        signatures = build()
        sess.run(tf.compat.v1.global_variables_initializer())
        builder = tf.compat.v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map=signatures)
        builder.save()
    return path


# -- loading the reference models -------------------------------------------------------------------------


def test_tf1_half_plus_two_signatures(tf1):
    assert set(tf1.signatures) == TF1_SIGNATURES
    sig = tf1.signatures["serving_default"]
    assert sig.name == "serving_default"
    assert sig.method_name == "tensorflow/serving/predict"
    assert set(sig.inputs) == {"x"}
    x = sig.inputs["x"]
    assert x.name == "x:0"
    assert x.dtype_enum == types_pb2.DT_FLOAT
    assert x.dtype == np.float32
    assert x.shape == (None, 1)
    assert x.describe() == "DT_FLOAT [-1,1]"
    assert set(sig.outputs) == {"y"}
    y = sig.outputs["y"]
    assert (y.name, y.dtype_enum, y.shape) == ("y:0", types_pb2.DT_FLOAT, (None, 1))
    assert sig.output_aliases == ("y",)
    assert sig.output_names == ("y:0",)


def test_tf1_string_input_of_unknown_rank(tf1):
    sig = tf1.signatures["classify_x_to_y"]
    assert sig.method_name == "tensorflow/serving/classify"
    spec = sig.inputs["inputs"]
    assert spec.name == "tf_example:0"
    assert spec.dtype_enum == types_pb2.DT_STRING
    assert spec.dtype == np.dtype(object)
    assert spec.shape is None
    assert spec.describe() == "DT_STRING ?"
    assert sig.outputs["scores"].name == "y:0"


def test_tf2_half_plus_two_signatures_hide_init_op(tf2):
    # The file holds TensorFlow's bookkeeping signature; the loaded model must not expose it.
    assert "__saved_model_init_op" in tf2.meta_graph.signature_def
    assert "__saved_model_init_op" not in tf2.signatures
    assert set(tf2.signatures) == TF1_SIGNATURES | {"classify_x2_to_y3"}
    sig = tf2.signatures["serving_default"]
    assert sig.method_name == "tensorflow/serving/predict"
    x = sig.inputs["x"]
    assert (x.name, x.dtype_enum, x.dtype) == ("serving_default_x:0", types_pb2.DT_FLOAT, np.float32)
    # TF2's export declares x (and y) as [1], not [-1,1] as the TF1 export does.
    assert x.shape == (1,)
    assert set(sig.outputs) == {"y"}
    assert sig.outputs["y"].dtype_enum == types_pb2.DT_FLOAT
    assert sig.output_names == (sig.outputs["y"].name,)


def test_signature_defaults_are_read_once_at_load(tf2, tmp_path):
    # TensorFlow Serving's TF2 export: serving_default's x defaults to [0.0] (SignatureDef.defaults).
    default = tf2.signatures["serving_default"].defaults["x"]
    assert default.dtype == np.float32 and default.tolist() == [0.0] and not default.flags.writeable
    assert tf2.signatures["regress_x_to_y"].defaults == {}

    class Scaled(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.float32)])
        def f(self, x, scale=tf.constant(2.0)):  # noqa: B008 - a tensor default is what TensorFlow records
            return {"y": x * scale}

    module = Scaled()
    tf.saved_model.save(module, str(tmp_path / "1"), signatures={"serving_default": module.f})
    model = load_saved_model(str(tmp_path / "1"))
    try:
        sig = model.signatures["serving_default"]
        assert set(sig.inputs) == {"x", "scale"} and set(sig.defaults) == {"scale"}
        assert sig.defaults["scale"].tolist() == 2.0
    finally:
        model.close()
    # A default that does not fit its input fails the load, naming both.
    pb = tmp_path / "1" / "saved_model.pb"
    saved = saved_model_pb2.SavedModel.FromString(pb.read_bytes())
    saved.meta_graphs[0].signature_def["serving_default"].defaults["scale"].CopyFrom(
        tf.make_tensor_proto(np.array([1, 2], np.int32))
    )
    pb.write_bytes(saved.SerializeToString())
    assert_load_error(str(tmp_path / "1"), "the default of input 'scale' is DT_INT32 [2]", "DT_FLOAT []")


def test_tf1_half_plus_two_runs(tf1):
    sig = tf1.signatures["serving_default"]
    executor = GraphExecutor(tf1)
    x = np.array([[1], [2], [5]], np.float32)
    (y,) = executor.run({sig.inputs["x"].name: x}, [sig.outputs["y"].name])
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, np.array([[2.5], [3.0], [4.5]], np.float32))


def test_tf2_half_plus_two_runs(tf2):
    sig = tf2.signatures["serving_default"]
    executor = GraphExecutor(tf2)
    got = [
        executor.run({sig.inputs["x"].name: np.array([v], np.float32)}, [sig.outputs["y"].name])[0]
        for v in (1.0, 2.0, 5.0)
    ]
    np.testing.assert_array_equal(np.stack(got), np.array([[2.5], [3.0], [4.5]], np.float32))


@pytest.mark.parametrize("which", ["tf1", "tf2"])
def test_graph_is_finalized_after_load(which, request):
    model = request.getfixturevalue(which)
    assert model.path == str(TF1_PATH if which == "tf1" else TF2_PATH)
    assert model.graph.finalized
    with model.graph.as_default(), pytest.raises(RuntimeError, match="finalized"):
        tf.constant(1.0)


# -- what does not load ------------------------------------------------------------------------------------


def assert_load_error(path, *words: str) -> LoadError:
    with pytest.raises(LoadError) as info:
        load_saved_model(str(path))
    error = info.value
    assert isinstance(error, ServingError)
    assert error.code == "FAILED_PRECONDITION"
    assert str(path) in error.message
    lowered = error.message.lower()
    for word in words:
        assert word.lower() in lowered, f"{word!r} not in {error.message!r}"
    return error


def test_missing_directory(tmp_path):
    assert_load_error(tmp_path / "nowhere" / "1", "does not exist")


def test_file_instead_of_directory(tmp_path):
    path = tmp_path / "saved_model.pb"
    path.write_bytes(b"")
    assert_load_error(path, "not a directory")


def test_directory_without_saved_model_pb(testdata):
    # An old export: checkpoint, export, export.meta and no saved_model.pb.
    path = BAD_HALF_PLUS_TWO / "00000123"
    error = assert_load_error(path, "saved_model.pb", "not a SavedModel")
    for found in ("checkpoint", "export.meta"):
        assert found in error.message


def test_corrupt_saved_model_pb(tmp_path, testdata):
    path = writable_copy(TF1_PATH, tmp_path / "1")
    (path / "saved_model.pb").write_bytes(b"\x00\xffthis is not a protocol buffer\xfe\x07" * 8)
    error = assert_load_error(path)
    assert "pars" in error.message.lower() or "corrupt" in error.message.lower(), error.message


def test_truncated_variables(tmp_path, testdata):
    path = writable_copy(TF1_PATH, tmp_path / "1")
    (data,) = (path / "variables").glob("variables.data-*")
    size = data.stat().st_size
    assert size > 1
    os.truncate(data, size // 2)
    error = assert_load_error(path)
    # TensorFlow's words: the restore op read fewer bytes than the index promised.
    assert "restore" in error.message.lower() or "bytes" in error.message.lower(), error.message


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_a_partitioned_tf1_variable_serves_its_saved_values(tmp_path, lazy):
    """Each part of a TF1 partitioned variable reads its slice of the one checkpoint entry."""
    path, ids = tmp_path / "1", np.array([0, 4, 5, 9], np.int64)
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        x = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        table = tf.compat.v1.get_variable(
            "emb", shape=[10, 4], initializer=tf.compat.v1.random_normal_initializer(seed=7),
            partitioner=tf.compat.v1.fixed_size_partitioner(2),
        )  # fmt: skip
        y = tf.identity(tf.nn.embedding_lookup(table, x), name="y")
        sess.run(tf.compat.v1.global_variables_initializer())
        values = np.arange(40, dtype=np.float32).reshape(10, 4)
        for part, rows in zip(table, (values[:5], values[5:]), strict=True):  # each part its own rows
            sess.run(part.assign(rows))
        expected = sess.run(y, {x: ids})
        np.testing.assert_array_equal(expected, values[ids])
        builder = tf.compat.v1.saved_model.Builder(str(path))
        signature = tf.compat.v1.saved_model.predict_signature_def({"ids": x}, {"y": y})
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map={"serving_default": signature})
        builder.save()
    model = load_saved_model(str(path), lazy_restore=lazy)
    try:
        records = model.variables.records
        assert {n: (r.key, r.shape, r.nbytes) for n, r in records.items()} == {
            "emb/part_0": ("emb", (5, 4), 80),
            "emb/part_1": ("emb", (5, 4), 80),
        }
        sig = model.signatures["serving_default"]
        got = GraphExecutor(model).run({sig.inputs["ids"].name: ids}, [sig.outputs["y"].name])[0]
        np.testing.assert_array_equal(got, expected)  # rows 0 and 4 from the first part, 5 and 9 from the second
    finally:
        model.close()


def test_a_checkpoint_entry_of_another_shape_fails_at_load(tmp_path):
    def export(path: Path, shape: tuple[int, int]) -> Path:
        module = tf.Module()
        module.w = tf.Variable(tf.zeros(shape), name="w")
        module.f = tf.function(lambda x: {"y": x * tf.reduce_sum(module.w)}, input_signature=[tf.TensorSpec([None])])
        tf.saved_model.save(module, str(path), signatures={"serving_default": module.f})
        return path

    model = export(tmp_path / "1", (2, 3))
    other = export(tmp_path / "other", (3, 2))
    shutil.rmtree(model / "variables")
    shutil.copytree(other / "variables", model / "variables")  # same key, another shape
    error = assert_load_error(model)
    assert "'w'" in error.message and "float32[2,3]" in error.message and "float32[3,2]" in error.message
    assert "w/.ATTRIBUTES/VARIABLE_VALUE" in error.message


def test_wrong_tag_set(testdata):
    with pytest.raises(LoadError) as info:
        load_saved_model(str(TF1_PATH), tags=("gpu",))
    assert str(TF1_PATH) in info.value.message
    assert "gpu" in info.value.message


def test_signature_naming_a_tensor_not_in_the_graph(tmp_path):
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        tf.identity(x * 2.0, name="y")
        missing = meta_graph_pb2.TensorInfo(name="missing:0", dtype=types_pb2.DT_FLOAT)
        sig = tf.compat.v1.saved_model.build_signature_def(
            inputs={"x": tf.compat.v1.saved_model.build_tensor_info(x)},
            outputs={"out": missing},
            method_name="tensorflow/serving/predict",
        )
        return {"serving_default": sig}

    path = export_tf1(tmp_path / "1", build)
    assert_load_error(path, "missing:0", "serving_default", "not in the graph")


def test_sparse_signature_input_is_rejected(tmp_path):
    def build():
        sp = tf.compat.v1.sparse_placeholder(tf.float32, name="sp")
        total = tf.sparse.reduce_sum(sp, name="total")
        sig = tf.compat.v1.saved_model.build_signature_def(
            inputs={"sp": tf.compat.v1.saved_model.build_tensor_info(sp)},
            outputs={"total": tf.compat.v1.saved_model.build_tensor_info(total)},
            method_name="tensorflow/serving/predict",
        )
        return {"serving_default": sig}

    path = export_tf1(tmp_path / "1", build)
    assert_load_error(path, "dense", "'sp'", "serving_default")


def test_own_tf1_export_loads_and_runs(tmp_path):
    def build():
        x = tf.compat.v1.placeholder(tf.int32, [None, 3], name="x")
        w = tf.compat.v1.Variable([1, 2, 3], name="w")
        y = tf.identity(x * w, name="y")
        info = tf.compat.v1.saved_model.build_tensor_info
        sig = tf.compat.v1.saved_model.build_signature_def(
            inputs={"x": info(x)},
            outputs={"y": info(y), "a_copy": info(tf.identity(x, name="xc"))},
            method_name="tensorflow/serving/predict",
        )
        return {"serving_default": sig}

    model = load_saved_model(str(export_tf1(tmp_path / "7", build)))
    try:
        sig = model.signatures["serving_default"]
        assert sig.inputs["x"].dtype == np.int32
        assert sig.inputs["x"].shape == (None, 3)
        # Output aliases come in a fixed (sorted) order, with their tensor names in the same order.
        assert sig.output_aliases == ("a_copy", "y")
        assert sig.output_names == ("xc:0", "y:0")
        x = np.array([[1, 1, 1], [2, 0, -1]], np.int32)
        (y,) = GraphExecutor(model).run({"x:0": x}, ["y:0"])
        np.testing.assert_array_equal(y, [[1, 2, 3], [2, 0, -3]])
    finally:
        model.close()


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_keras_model_saved_with_tf_saved_model_save_serves_its_trained_values(tmp_path, lazy):
    # Keras 3 under tf.saved_model.save: the serving function reads handles (embedding/embeddings, ...) that the
    # SavedModel's restore function never assigns (it restores other handles); TensorFlow's object loader goes by
    # the object graph, and so must servex, or every call fails with "Could not find variable".
    text = tf.keras.Input((), dtype=tf.string)
    ids = tf.keras.layers.StringLookup(vocabulary=["a", "b", "c"])(text)
    embedded = tf.keras.layers.Embedding(4, 3, embeddings_initializer="random_normal")(ids)
    scores = tf.keras.layers.Dense(2)(tf.keras.layers.BatchNormalization()(embedded))
    model = tf.keras.Model(text, scores)
    path = tmp_path / "1"
    tf.saved_model.save(model, str(path))
    words = np.array([b"a", b"c", b"unknown"], dtype=object)
    expected = tf.saved_model.load(str(path)).signatures["serving_default"](tf.constant(words))
    expected = next(iter(expected.values())).numpy()
    assert np.abs(expected).max() > 0  # trained (random) values, not zeros

    loaded = load_saved_model(str(path), lazy_restore=lazy)
    sig = loaded.signatures["serving_default"]
    (feed,) = [spec.name for spec in sig.inputs.values()]
    (fetch,) = [spec.name for spec in sig.outputs.values()]
    (got,) = GraphExecutor(loaded).run({feed: words}, [fetch])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_an_init_op_runs_unless_it_is_a_bare_no_op():
    graph = tf.Graph()
    with graph.as_default():
        v = tf.compat.v1.Variable(1.0, name="v", use_resource=False)
        bare = tf.no_op(name="bare")
        with tf.control_dependencies([v.initializer]):
            grouping = tf.no_op(name="grouping")
    assert _runs_nothing(bare)
    assert not _runs_nothing(grouping) and not _runs_nothing(v.initializer)


def test_a_tf2_table_initialized_by_the_init_op_serves(tmp_path):
    """A TF2 export's init op is a NoOp that waits for its tables' initializers: it runs."""
    path = str(tmp_path / "1")
    module = tf.Module()
    module.table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(["a", "b"]), tf.constant([1, 2], tf.int64)), default_value=-1
    )
    module.f = tf.function(lambda k: {"v": module.table.lookup(k)}, input_signature=[tf.TensorSpec([None], tf.string)])
    tf.saved_model.save(module, path, signatures={"serving_default": module.f})
    model = load_saved_model(path)
    try:
        sig = model.signatures["serving_default"]
        keys = np.array([b"b", b"z", b"a"], dtype=object)
        got = GraphExecutor(model).run({sig.inputs["k"].name: keys}, [sig.outputs["v"].name])[0]
        assert got.tolist() == [2, -1, 1]
    finally:
        model.close()
