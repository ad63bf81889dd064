"""GraphExecutor: client-graph keys, feed/fetch order, checks of inputs, targets, the variables read, the transfer
step and what the session answers (the cache under threads: test_client_graph_cache.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from servex.executor import GraphExecutor, client_graph_key
from servex.loader import InvalidArgument, ServingError, load_saved_model
from servex.transfer import H2DTransferExecutor, H2DTransferExecutorFactory, TransferFuture
from tests.conftest import COUNTER

X = np.array([[1], [2], [5]], np.float32)
Y = np.array([[2.5], [3.0], [4.5]], np.float32)  # 0.5x + 2
Y2 = np.array([[3.5], [4.0], [5.5]], np.float32)  # 0.5x + 3


# -- models --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def counter(testdata):
    model = load_saved_model(str(COUNTER / "00000123"))
    yield model
    model.close()


class _SumDiff(tf.Module):
    @tf.function(
        input_signature=[tf.TensorSpec([None, 2], tf.float32, name="a"), tf.TensorSpec([None, 2], tf.float32, name="b")]
    )
    def f(self, a, b):
        return {"sum": a + b, "diff": a - b}


@pytest.fixture(scope="module")
def sum_diff(tmp_path_factory):
    """A TF2 export with two inputs and two outputs, where order matters (a - b)."""
    path = tmp_path_factory.mktemp("sum_diff") / "1"
    module = _SumDiff()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.f})
    model = load_saved_model(str(path))
    sig = model.signatures["serving_default"]
    names = {alias: spec.name for alias, spec in [*sig.inputs.items(), *sig.outputs.items()]}
    yield model, names
    model.close()


def export_dashed_targets(path: Path) -> Path:
    """TF1 export: variable v and four assign-add ops whose names contain '-' (legal in TensorFlow op names),
    each the output of a signature of its own (ops that assign run by name only as a signature runs them)."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        v = tf.compat.v1.Variable(0.0, name="v", use_resource=False)
        info = tf.compat.v1.saved_model.build_tensor_info
        predict = "tensorflow/serving/predict"
        signatures = {}
        for name, step in (("p", 1.0), ("q-r", 10.0), ("p-q", 100.0), ("r", 1000.0)):
            added = tf.compat.v1.assign_add(v, step, name=name)
            signatures[f"add_{name}"] = tf.compat.v1.saved_model.build_signature_def(
                outputs={"v": info(added)}, method_name=predict
            )
        sess.run(tf.compat.v1.global_variables_initializer())
        signatures["get"] = tf.compat.v1.saved_model.build_signature_def(
            outputs={"v": info(tf.identity(v, name="v_value"))}, method_name=predict
        )
        builder = tf.compat.v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map=signatures)
        builder.save()
    return path


# -- client_graph_key -----------------------------------------------------------------------------------------


def test_key_format():
    assert client_graph_key(["a", "b"], ["c", "d"], ["t1", "t2"]) == "a-b^c-d^t1-t2"
    assert client_graph_key(["x:0"], ["y:0"]) == "x:0^y:0^"
    assert client_graph_key([], ["y:0"], ["init"]) == "^y:0^init"


def test_key_is_the_same_for_every_order():
    feeds, fetches, targets = ["in_b:0", "in_a:0", "in_c:0"], ["z:0", "y:0", "x:1"], ["t2", "t1", "t3"]
    expected = "in_a:0-in_b:0-in_c:0^x:1-y:0-z:0^t1-t2-t3"
    keys = {
        client_graph_key(f, o, t)
        for f, o, t in itertools.product(
            itertools.permutations(feeds), itertools.permutations(fetches), itertools.permutations(targets)
        )
    }
    assert keys == {expected}


def test_key_tells_feeds_fetches_and_targets_apart():
    assert client_graph_key(["a:0"], ["b:0"]) != client_graph_key(["b:0"], ["a:0"])
    assert client_graph_key([], ["a:0"], ["b"]) != client_graph_key([], ["a:0", "b"])


# -- order --------------------------------------------------------------------------------------------------


def test_outputs_come_back_in_the_callers_order(half):
    executor = GraphExecutor(half)
    y, y2 = executor.run({"x:0": X}, ["y:0", "y2:0"])
    np.testing.assert_array_equal(y, Y)
    np.testing.assert_array_equal(y2, Y2)
    y2, y = executor.run({"x:0": X}, ["y2:0", "y:0"])
    np.testing.assert_array_equal(y, Y)
    np.testing.assert_array_equal(y2, Y2)
    assert executor.cached_keys() == ["x:0^y2:0-y:0^"]
    assert executor.builds == 1


def test_feed_and_fetch_order_change_neither_results_nor_cache(sum_diff):
    model, n = sum_diff
    executor = GraphExecutor(model)
    a = np.array([[1, 2], [3, 4]], np.float32)
    b = np.array([[10, 20], [30, 40]], np.float32)
    total, diff = executor.run({n["a"]: a, n["b"]: b}, [n["sum"], n["diff"]])
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(diff, a - b)
    for feeds in ({n["a"]: a, n["b"]: b}, {n["b"]: b, n["a"]: a}):
        for fetches, expected in (([n["sum"], n["diff"]], [a + b, a - b]), ([n["diff"], n["sum"]], [a - b, a + b])):
            got = executor.run(feeds, fetches)
            assert len(got) == 2
            for g, e in zip(got, expected, strict=True):
                np.testing.assert_array_equal(g, e)
    assert len(executor.cached_keys()) == 1
    assert executor.builds == 1
    graph = executor.client_graph([n["b"], n["a"]], [n["diff"], n["sum"]])
    assert graph is executor.client_graph([n["a"], n["b"]], [n["sum"], n["diff"]])
    assert executor.builds == 1


def test_two_feeds_of_the_reference_model(half):
    executor = GraphExecutor(half)
    x2 = np.array([[4], [6], [0]], np.float32)
    y3, y = executor.run({"x2:0": x2, "x:0": X}, ["y3:0", "y:0"])
    np.testing.assert_array_equal(y, Y)
    np.testing.assert_array_equal(y3, 0.5 * x2 + 3)
    y, y3 = executor.run({"x:0": X, "x2:0": x2}, ["y:0", "y3:0"])
    np.testing.assert_array_equal(y, Y)
    np.testing.assert_array_equal(y3, 0.5 * x2 + 3)
    assert executor.builds == 1


def test_same_fetch_listed_twice(half):
    executor = GraphExecutor(half)
    got = executor.run({"x:0": X}, ["y:0", "y2:0", "y:0"])
    assert len(got) == 3
    np.testing.assert_array_equal(got[0], Y)
    np.testing.assert_array_equal(got[1], Y2)
    np.testing.assert_array_equal(got[2], Y)


def test_dtype_mismatch(half):
    executor = GraphExecutor(half)
    with pytest.raises(InvalidArgument) as info:
        executor.run({"x:0": X.astype(np.float64)}, ["y:0"])
    assert info.value.code == "INVALID_ARGUMENT"
    for word in ("'x:0'", "float32", "float64"):
        assert word in info.value.message


def test_shape_mismatch(half):
    shape = (3, 2)  # same rank, another non-batch dimension
    executor = GraphExecutor(half)
    with pytest.raises(InvalidArgument) as info:
        executor.run({"x:0": np.ones(shape, np.float32)}, ["y:0"])
    assert "'x:0'" in info.value.message
    assert "[-1,1]" in info.value.message
    assert str(list(shape)) in info.value.message


@pytest.mark.parametrize("shape", [(3,), (3, 1, 1)])
def test_another_rank_is_left_to_tensorflow(half, shape):
    # As TensorFlow Serving: half_plus_two's x is [-1,1], and its elementwise graph takes any shape
    # (TensorFlow Serving's REST example sends {"instances": [1.0, 2.0, 5.0]}).
    executor = GraphExecutor(half)
    x = np.arange(3, dtype=np.float32).reshape(shape)
    (y,) = executor.run({"x:0": x}, ["y:0"])
    np.testing.assert_array_equal(y, 0.5 * x + 2)


def test_another_rank_that_an_op_refuses_is_tensorflows_invalid_argument(sum_diff):
    model, n = sum_diff
    executor = GraphExecutor(model)
    feeds = {n["a"]: np.ones((2, 2, 2), np.float32), n["b"]: np.ones(3, np.float32)}  # not broadcastable
    with pytest.raises(ServingError) as info:
        executor.run(feeds, [n["sum"]])
    assert info.value.code == "INVALID_ARGUMENT" and "failed" in info.value.message


def test_other_batch_sizes_are_accepted(half):
    executor = GraphExecutor(half)
    for batch in (0, 1, 7):
        (y,) = executor.run({"x:0": np.full((batch, 1), 2.0, np.float32)}, ["y:0"])
        np.testing.assert_array_equal(y, np.full((batch, 1), 3.0, np.float32))


@pytest.mark.parametrize(
    "inputs, fetches, targets, words",
    [
        ({"nope:0": X}, ["y:0"], [], ["'nope:0'", "feed"]),
        ({"x:0": X}, ["nope:0"], [], ["'nope:0'", "fetch"]),
        ({"x:0": X}, ["y"], [], ["'y'", "fetch"]),  # an operation's name, not a tensor's
        ({"x:0": X}, ["y:7"], [], ["'y:7'"]),
        ({"x:0": X}, ["y:0"], ["nope"], ["'nope'", "target"]),
    ],
)
def test_unknown_names(half, inputs, fetches, targets, words):
    executor = GraphExecutor(half)
    with pytest.raises(InvalidArgument) as info:
        executor.run(inputs, fetches, targets)
    for word in words:
        assert word in info.value.message
    assert "the model's graph" in info.value.message and half.path not in info.value.message  # no server paths
    assert executor.cached_keys() == []
    assert executor.builds == 0


def test_tensor_both_fed_and_fetched_is_an_invalid_argument(half):
    # TensorFlow refuses to build such a callable; the caller must get the serving error, not TF's own type.
    executor = GraphExecutor(half)
    with pytest.raises(ServingError) as info:
        executor.run({"x:0": X}, ["x:0", "y:0"])
    assert info.value.code == "INVALID_ARGUMENT"
    assert "x:0" in info.value.message
    assert executor.cached_keys() == []


def test_missing_feed_is_a_serving_error(half):
    # y:0 needs tf_example:0 (x is parsed from it) when x:0 is not fed.
    executor = GraphExecutor(half)
    with pytest.raises(ServingError) as info:
        executor.run({}, ["y:0"])
    assert info.value.code == "INVALID_ARGUMENT"
    assert "tf_example" in info.value.message


# -- targets ------------------------------------------------------------------------------------------------


def _op(tensor_name: str) -> str:
    return tensor_name.rsplit(":", 1)[0]


def test_target_runs_the_counters_increment(counter):
    sigs = counter.signatures
    value = sigs["get_counter"].outputs["output"].name
    incr = _op(sigs["incr_counter"].outputs["output"].name)
    incr_by = _op(sigs["incr_counter_by"].outputs["output"].name)
    delta = sigs["incr_counter_by"].inputs["delta"].name
    executor = GraphExecutor(counter)
    (before,) = executor.run({}, [value])
    assert executor.run({}, [], [incr]) == []
    assert executor.run({}, [value])[0] == before + 1
    executor.run({}, [], [incr])
    assert executor.run({}, [value])[0] == before + 2
    executor.run({delta: np.array(5.0, np.float32)}, [], [incr_by])
    assert executor.run({}, [value])[0] == before + 7
    graph = executor.client_graph([], [], [incr])
    assert graph.target_names == (incr,)
    assert graph.fetch_names == ()
    assert graph.variables == frozenset({"counter"})


def test_reset_counter_target(counter):
    sigs = counter.signatures
    value = sigs["get_counter"].outputs["output"].name
    executor = GraphExecutor(counter)
    executor.run({}, [], [_op(sigs["incr_counter"].outputs["output"].name)])
    assert executor.run({}, [value])[0] != 0
    executor.run({}, [], [_op(sigs["reset_counter"].outputs["output"].name)])
    assert executor.run({}, [value])[0] == 0


def test_targets_whose_names_contain_a_dash(tmp_path):
    # Op names may contain '-', so the joined key of targets ['p-q', 'r'] and of ['p', 'q-r'] is the same
    # string; running one set must never run the other's operations.
    model = load_saved_model(str(export_dashed_targets(tmp_path / "1")))
    try:
        executor = GraphExecutor(model)
        executor.run({}, [], ["p-q", "r"])  # +100 +1000
        executor.run({}, [], ["p", "q-r"])  # +1 +10
        (v,) = executor.run({}, ["v:0"])
        assert v == 1111.0
    finally:
        model.close()


# -- variables the pruned graph reads ------------------------------------------------------------------------


def test_variables_read(half):
    executor = GraphExecutor(half)
    assert executor.client_graph(["x:0"], ["y:0"]).variables == frozenset({"a", "b"})
    assert executor.client_graph(["x:0"], ["y2:0"]).variables == frozenset({"a", "c"})
    assert executor.client_graph(["x2:0"], ["y3:0"]).variables == frozenset({"a2", "c2"})
    assert executor.client_graph(["x:0", "x2:0"], ["y:0", "y3:0"]).variables == frozenset({"a", "b", "a2", "c2"})
    # x is parsed from tf_example; no variable lies on that path.
    assert executor.client_graph(["tf_example:0"], ["x:0"]).variables == frozenset()
    # Feeding a/read:0 cuts variable a out of the pruned graph.
    graph = executor.client_graph(["x:0", "a/read:0"], ["y:0"])
    assert graph.variables == frozenset({"b"})
    (y,) = executor.run({"a/read:0": np.array(10.0, np.float32), "x:0": X}, ["y:0"])
    np.testing.assert_array_equal(y, 10 * X + 2)


def test_variables_read_by_a_tf2_function(half_tf2):
    sig = half_tf2.signatures["serving_default"]
    graph = GraphExecutor(half_tf2).client_graph([sig.inputs["x"].name], [sig.outputs["y"].name])
    assert graph.variables == frozenset({"a", "b"})
    assert all(half_tf2.graph.get_operation_by_name(v).type == "VarHandleOp" for v in graph.variables)


# -- a transfer step that copies -----------------------------------------------------------------------------


class _CopyingExecutor(H2DTransferExecutor):
    def __init__(self, log: list):
        self.log = log
        self.scheduled: list[tuple[np.ndarray, TransferFuture]] = []

    def schedule(self, array: np.ndarray) -> TransferFuture:
        self.log.append(("schedule", array))
        future = TransferFuture()
        self.scheduled.append((array, future))
        return future

    def run(self) -> None:
        self.log.append(("run", None))
        for array, future in self.scheduled:
            copy = array.copy()
            self.log.append(("copy", copy))
            future.set(copy)


class _CopyingFactory(H2DTransferExecutorFactory):
    device = "copy"

    def __init__(self):
        self.log: list = []
        self.created = 0

    def create(self) -> H2DTransferExecutor:
        self.created += 1
        return _CopyingExecutor(self.log)


def test_inputs_go_through_the_transfer_executor(half):
    factory = _CopyingFactory()
    executor = GraphExecutor(half, transfer=factory)
    x2 = np.array([[2]], np.float32)
    x = np.array([[4]], np.float32)
    y, y3 = executor.run({"x:0": x, "x2:0": x2}, ["y:0", "y3:0"])
    np.testing.assert_array_equal(y, [[4.0]])
    np.testing.assert_array_equal(y3, [[4.0]])
    assert factory.created == 1
    kinds = [kind for kind, _ in factory.log]
    assert kinds == ["schedule", "schedule", "run", "copy", "copy"]
    # Scheduled in the client graph's (sorted) feed order: x2:0 before x:0.
    assert factory.log[0][1] is x2 and factory.log[1][1] is x
    executor.run({"x:0": x, "x2:0": x2}, ["y:0", "y3:0"])
    assert factory.created == 2  # a fresh transfer executor per run


# -- what the session answers: always ndarrays ----------------------------------------------------------------


class _ScalarString(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([], tf.string, name="s")])
    def echo(self, s):
        return {"out": s, "length": tf.strings.length(s)}


@pytest.fixture(scope="module")
def scalar_string(tmp_path_factory):
    """A TF2 export whose signature takes and answers 0-d tensors: a DT_STRING and an int32."""
    path = tmp_path_factory.mktemp("scalar_string") / "1"
    module = _ScalarString()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.echo})
    model = load_saved_model(str(path))
    yield model
    model.close()


def test_a_signature_s_scalar_string_output_comes_back_as_an_ndarray(scalar_string):
    sig = scalar_string.signatures["serving_default"]
    executor = GraphExecutor(scalar_string)
    fetches = [sig.outputs["out"].name, sig.outputs["length"].name]
    out, length = executor.run({sig.inputs["s"].name: np.array(b"hi", dtype=object)}, fetches)
    assert isinstance(out, np.ndarray) and out.dtype == object and out.shape == () and out.item() == b"hi"
    assert isinstance(length, np.ndarray) and length.dtype == np.int32 and length.shape == () and length == 2


def test_scalar_fetches_by_name_come_back_as_ndarrays(half):
    executor = GraphExecutor(half)
    name, a = executor.run({}, ["save/Const:0", "a:0"])  # a 0-d DT_STRING constant and a 0-d float variable
    assert isinstance(name, np.ndarray) and name.dtype == object and name.shape == () and name.item() == b"model"
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == () and a == 0.5
    (y,) = executor.run({"x:0": X}, ["y:0"])  # arrays pass through untouched
    np.testing.assert_array_equal(y, Y)


# -- TensorFlow errors whose message is not UTF-8 -------------------------------------------------------------


def test_a_tensorflow_error_quoting_bytes_that_are_not_utf8_is_invalid_argument(half):
    # ParseExample quotes the client's bytes; TensorFlow then fails to make a Python string of its own message.
    sig = half.signatures["classify_x_to_y"]
    executor = GraphExecutor(half)
    examples = np.array([b"\xff\x00garbage", b"\xff\x00garbage"], dtype=object)
    with pytest.raises(ServingError) as info:
        executor.run({sig.inputs["inputs"].name: examples}, list(sig.output_names))
    assert info.value.code == "INVALID_ARGUMENT"
    assert "TensorFlow's error" in info.value.message
    assert "Could not parse example input" in info.value.message
    assert "\ufffd" in info.value.message
    (y,) = executor.run({"x:0": X}, ["y:0"])  # still serving
    np.testing.assert_array_equal(y, Y)


# -- handles cannot be fed or fetched -------------------------------------------------------------------------


def export_variant(path: Path) -> Path:
    """TF1 export with a DT_VARIANT tensor in its graph: x -> TensorList 'lst' -> y (stacked back)."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        x = tf.compat.v1.placeholder(tf.float32, [None, 1], name="x")
        lst = tf.raw_ops.TensorListFromTensor(tensor=x, element_shape=tf.constant([1]), name="lst")
        y = tf.raw_ops.TensorListStack(input_handle=lst, element_shape=tf.constant([1]), element_dtype=tf.float32)
        y = tf.identity(y, name="y")
        info = tf.compat.v1.saved_model.build_tensor_info
        sig = tf.compat.v1.saved_model.build_signature_def(
            inputs={"x": info(x)}, outputs={"y": info(y)}, method_name="tensorflow/serving/predict"
        )
        builder = tf.compat.v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map={"serving_default": sig})
        builder.save()
    return path


def test_a_resource_tensor_can_be_neither_fed_nor_fetched(half_tf2):
    executor = GraphExecutor(half_tf2)
    with pytest.raises(InvalidArgument) as info:
        executor.run({"a:0": np.array(b"x", dtype=object)}, ["a/Read/ReadVariableOp:0"])
    for fragment in ("cannot feed 'a:0'", "DT_RESOURCE", "cannot be fed"):
        assert fragment in info.value.message
    with pytest.raises(InvalidArgument) as info:
        executor.run({}, ["a:0"])
    for fragment in ("cannot fetch 'a:0'", "DT_RESOURCE"):
        assert fragment in info.value.message
    assert executor.run({}, ["a/Read/ReadVariableOp:0"])[0] == 0.5
    assert executor.builds == 1


def test_a_variant_tensor_can_be_neither_fed_nor_fetched(tmp_path):
    model = load_saved_model(str(export_variant(tmp_path / "1")))
    try:
        executor = GraphExecutor(model)
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], X)
        with pytest.raises(InvalidArgument, match=r"cannot feed 'lst:0'.*DT_VARIANT.*cannot be fed"):
            executor.run({"lst:0": np.zeros((), np.float32)}, ["y:0"])
        with pytest.raises(InvalidArgument, match=r"cannot fetch 'lst:0'.*DT_VARIANT"):
            executor.run({"x:0": X}, ["lst:0"])
    finally:
        model.close()
