"""Runs by tensor name may run a state-changing or file-touching op only as one of the model's signatures runs it:
a client cannot rewrite a served variable (the initializer's Assign) or write checkpoints (the Saver's SaveV2)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from servex.executor import GraphExecutor
from servex.executor.op_policy import STATE_CHANGING_OPS
from servex.loader import PermissionDenied, load_saved_model
from tests.conftest import COUNTER

X = np.array([[1.0], [2.0]], np.float32)


def export_tf1(path: Path) -> Path:
    """TF1: ref variable v (3.0) and resource variable w (1.0), each with its initializer's assign op; a Saver;
    signature ``serving_default``: x -> y = x * v + w."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        x = tf.compat.v1.placeholder(tf.float32, [None, 1], name="x")
        v = tf.compat.v1.Variable(3.0, name="v", use_resource=False)
        w = tf.compat.v1.Variable(1.0, name="w", use_resource=True)
        y = tf.identity(x * v + w, name="y")
        sess.run(tf.compat.v1.global_variables_initializer())
        info = tf.compat.v1.saved_model.build_tensor_info
        sig = tf.compat.v1.saved_model.build_signature_def(
            inputs={"x": info(x)}, outputs={"y": info(y)}, method_name="tensorflow/serving/predict"
        )
        builder = tf.compat.v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(
            sess, ["serve"], signature_def_map={"serving_default": sig}, saver=tf.compat.v1.train.Saver()
        )
        builder.save()
    return path


@pytest.fixture(scope="module")
def tf1(tmp_path_factory):
    model = load_saved_model(str(export_tf1(tmp_path_factory.mktemp("tf1") / "1")))
    yield model
    model.close()


@pytest.fixture
def counter(testdata):  # a fresh one per test: tests change its counter
    model = load_saved_model(str(COUNTER / "00000123"))
    yield model
    model.close()


def refused(executor, feeds, fetches, targets=(), graph_name="") -> str:
    with pytest.raises(PermissionDenied) as info:
        executor.run(feeds, fetches, targets, graph_name)
    assert info.value.code == "PERMISSION_DENIED"
    return info.value.message


def assert_names_the_rule(message: str, op: str, op_type: str) -> None:
    for fragment in (f"'{op}'", op_type, "signature", "AssignVariable"):
        assert fragment in message, message


def y_of(executor, x=X):
    return executor.run({"x:0": x}, ["y:0"])[0]


# -- variables ------------------------------------------------------------------------------------------------


def test_an_initializer_s_assign_is_refused_and_the_variable_keeps_its_value(tf1):
    executor = GraphExecutor(tf1)
    np.testing.assert_array_equal(y_of(executor), X * 3 + 1)
    value = np.array(100.0, np.float32)
    message = refused(executor, {"v/initial_value:0": value}, [], ["v/Assign"])  # as a target
    assert_names_the_rule(message, "v/Assign", "type Assign")
    message = refused(executor, {"v/initial_value:0": value}, ["v/Assign:0"])  # as a fetch
    assert_names_the_rule(message, "v/Assign", "type Assign")
    message = refused(executor, {"w/Initializer/initial_value:0": value}, [], ["w/Assign"])  # a resource variable
    assert_names_the_rule(message, "w/Assign", "type AssignVariableOp")
    message = refused(executor, {"v/initial_value:0": value}, [], ["v/Assign"], graph_name="mine")  # named graph
    assert_names_the_rule(message, "v/Assign", "type Assign")
    np.testing.assert_array_equal(y_of(executor), X * 3 + 1)
    assert executor.cached_keys() == ["x:0^y:0^"]  # nothing refused was built


def test_the_restore_assign_servex_adds_is_not_runnable_by_name(tf1):
    executor = GraphExecutor(tf1)
    record = tf1.variables.records["v"]  # the read/assign pair that lazy restoration runs itself
    assert record.assign.startswith("servex_restore/")
    message = refused(executor, {record.value: np.array(7.0, np.float32)}, [], [record.assign])
    assert_names_the_rule(message, record.assign, "type Assign")
    np.testing.assert_array_equal(y_of(executor), X * 3 + 1)


def test_reads_of_variables_by_name_still_run(tf1):
    executor = GraphExecutor(tf1)
    v, w = executor.run({}, ["v:0", "w/Read/ReadVariableOp:0"])
    assert v == 3.0 and w == 1.0


# -- checkpoints and files ------------------------------------------------------------------------------------


def test_save_is_refused_and_writes_no_file(tf1, tmp_path):
    executor = GraphExecutor(tf1)
    prefix = np.array(str(tmp_path / "stolen").encode(), dtype=object)
    message = refused(executor, {"save/Const:0": prefix}, ["save/control_dependency:0"])
    assert_names_the_rule(message, "save/SaveV2", "type SaveV2")
    refused(executor, {"save/Const:0": prefix}, [], ["save/SaveV2"])
    refused(executor, {"save/Const:0": prefix}, ["save/Identity:0"])  # SaveV2 and MergeV2Checkpoints
    assert list(tmp_path.iterdir()) == []


def test_restore_is_refused(tf1, tmp_path):
    executor = GraphExecutor(tf1)
    prefix = np.array(str(tmp_path / "ckpt").encode(), dtype=object)
    message = refused(executor, {"save/Const:0": prefix}, [], ["save/restore_all"])
    assert "RestoreV2" in message and "Assign" in message and "more" not in message  # 2 assigns and the read
    np.testing.assert_array_equal(y_of(executor), X * 3 + 1)


def test_half_plus_two_assign_and_save_are_refused_and_its_answer_stands(half, tmp_path):
    executor = GraphExecutor(half)
    np.testing.assert_array_equal(y_of(executor), 0.5 * X + 2)
    message = refused(executor, {"a/initial_value:0": np.array(100.0, np.float32)}, [], ["a/Assign"])
    assert_names_the_rule(message, "a/Assign", "type Assign")
    prefix = np.array(str(tmp_path / "x").encode(), dtype=object)
    message = refused(executor, {"save/Const:0": prefix}, ["save/control_dependency:0"])
    assert_names_the_rule(message, "save/SaveV2", "type SaveV2")
    message = refused(executor, {"save/Const:0": prefix}, [], ["save/restore_all"])
    assert "RestoreV2" in message and "and 3 more" in message  # 5 assigns and the read: the first 3 named
    assert list(tmp_path.iterdir()) == []
    np.testing.assert_array_equal(y_of(executor), 0.5 * X + 2)
    # Everything a signature computes still runs by name, as do other reads.
    y, y2 = executor.run({"x:0": X}, ["y:0", "y2:0"])
    np.testing.assert_array_equal(y2, 0.5 * X + 3)
    assert executor.run({}, ["a:0"])[0] == 0.5


# -- TF2: state-changing ops inside functions ------------------------------------------------------------------


def _consumers(model, tensor: str) -> list[str]:
    return sorted(op.name for op in model.graph.get_operations() if tensor in [t.name for t in op.inputs])


def test_tf2_save_and_restore_functions_are_refused(half_tf2, tmp_path):
    executor = GraphExecutor(half_tf2)
    prefix = np.array(str(tmp_path / "x").encode(), dtype=object)
    calls = _consumers(half_tf2, "saver_filename:0")
    assert len(calls) == 2  # the save function and the restore function
    kinds = []
    for call in calls:
        message = refused(executor, {"saver_filename:0": prefix}, [f"{call}:0"])
        assert_names_the_rule(message, call, "StatefulPartitionedCall, calling functions that run")
        kinds.append(message)
    assert any("SaveV2" in m for m in kinds) and any("RestoreV2" in m and "AssignVariableOp" in m for m in kinds)
    assert list(tmp_path.iterdir()) == []
    message = refused(executor, {"asset_path_initializer:0": prefix}, [], ["Variable/Assign"])
    assert_names_the_rule(message, "Variable/Assign", "type AssignVariableOp")
    sig = half_tf2.signatures["serving_default"]
    x = np.array([1.0, 2.0, 5.0], np.float32)
    (y,) = executor.run({sig.inputs["x"].name: x}, [sig.outputs["y"].name])  # its own call: no state change
    np.testing.assert_array_equal(y, [2.5, 3.0, 4.5])


# -- signatures that change state ------------------------------------------------------------------------------


def _op(tensor_name: str) -> str:
    return tensor_name.rsplit(":", 1)[0]


def test_the_counter_s_signatures_run_by_name_but_only_with_their_own_inputs(counter):
    sigs = counter.signatures
    value = sigs["get_counter"].outputs["output"].name
    incr = sigs["incr_counter"].outputs["output"].name
    incr_by = sigs["incr_counter_by"].outputs["output"].name
    delta = sigs["incr_counter_by"].inputs["delta"].name
    executor = GraphExecutor(counter)
    assert executor.run({}, [incr])[0] == 1  # as Predict on incr_counter runs it
    assert executor.run({}, [], [_op(incr)]) == []  # its op as a target
    assert executor.run({delta: np.array(5.0, np.float32)}, [incr_by])[0] == 7
    # Feeding a tensor inside a signature, upstream of its assign, would let a client write any value.
    step = f"{_op(incr)}/value:0"
    message = refused(executor, {step: np.array(1000.0, np.float32)}, [incr])
    assert f"'{step}' fed" in message and "signature's inputs" in message
    assert_names_the_rule(message, _op(incr), "type AssignAdd")
    message = refused(executor, {"reset_counter_op/Assign/value:0": np.array(-50.0, np.float32)},
                      [], ["reset_counter_op/Assign"])  # fmt: skip
    assert "'reset_counter_op/Assign/value:0' fed" in message
    # The initializer and the saver are in no signature.
    refused(executor, {}, [], ["counter/Assign"])
    refused(executor, {"counter/initial_value:0": np.array(50.0, np.float32)}, [], ["counter/Assign"])
    assert executor.run({}, [value])[0] == 7


def test_the_allowed_ops_are_worked_out_once_per_model(counter):
    executor = GraphExecutor(counter)
    executor.run({}, [counter.signatures["get_counter"].outputs["output"].name])
    policy = executor._policy
    assert policy is not None
    assert set(policy.allowed) == {
        "incr_counter_op/AssignAdd",
        "incr_counter_by_op/AssignAdd",
        "reset_counter_op/Assign",
    }
    executor.run({}, [counter.signatures["incr_counter"].outputs["output"].name])
    refused(executor, {}, [], ["counter/Assign"])
    assert executor._policy is policy


# -- the list --------------------------------------------------------------------------------------------------


def _registered_ops() -> list[str]:
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session as c_api

    ops = op_def_pb2.OpList()
    ops.ParseFromString(c_api.TF_GetBuffer(c_api.TF_GetAllOpList()))
    return [op.name for op in ops.op]


def test_every_listed_op_type_is_one_tensorflow_knows():
    assert [name for name in sorted(STATE_CHANGING_OPS) if op_def_registry.get(name) is None] == []


def test_every_variable_writing_op_family_of_tensorflow_is_listed():
    families = re.compile(
        r"^(Resource)?(Sparse)?Apply[A-Z]\w*$"  # optimizer steps
        r"|^(Resource)?Scatter(?!Nd$|NdNonAliasingAdd$)\w*$"  # scatter updates of a variable, not the pure ScatterNd
        r"|^Assign\w*$|^(Resource)?CountUpTo$|^(Resource)?StridedSliceAssign$"
        r"|^(Save|Restore|MergeV2Checkpoints)\w*$|^(Read|Write)File$|^LookupTable(Insert|Remove|Import)\w*$"
    )
    missing = sorted(name for name in _registered_ops() if families.match(name) and name not in STATE_CHANGING_OPS)
    assert missing == []
