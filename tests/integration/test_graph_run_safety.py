"""Runs by tensor name on the public port (TensorFlow Serving's SessionRun, servex.v1 GraphExecutor.Run) cannot
change a served model for every client nor touch files: a state-changing op runs only as one of the model's
signatures runs it. Through the real daemon, against TensorFlow Serving's test models."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.support.clients import expect_error, predict_outputs, run, session_run

X = np.array([[1.0], [2.0], [5.0]], np.float32)
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def daemon(graph_daemon):
    """half (TF1 half_plus_two), half2 (TF2) and counter, among others: the daemon test_graph_runs.py shares."""
    return graph_daemon


def test_assigning_a_variable_by_name_is_denied_and_changes_nothing(daemon):
    ch = daemon.channel
    np.testing.assert_array_equal(predict_outputs(ch, "half", {"x": X})["y"], 0.5 * X + 2)
    feeds = {"a/initial_value:0": np.float32(100)}
    fragments = ["'a/Assign'", "type Assign", "signature", "AssignVariable"]
    expect_error(DENIED, fragments, session_run, ch, "half", feeds, targets=["a/Assign"])
    expect_error(DENIED, fragments, session_run, ch, "half", feeds, ["a/Assign:0"])
    expect_error(DENIED, fragments, run, ch, "half", feeds, [], ["a/Assign"])
    expect_error(DENIED, fragments, run, ch, "half", feeds, [], ["a/Assign"], graph_name="assign")
    # every client's answer stands
    np.testing.assert_array_equal(predict_outputs(ch, "half", {"x": X})["y"], 0.5 * X + 2)
    assert session_run(ch, "half", fetches=["a:0"])[0]["a:0"] == 0.5


def test_saving_a_checkpoint_by_name_is_denied_and_writes_no_file(daemon, tmp_path):
    ch = daemon.channel
    prefix = np.array(str(tmp_path / "stolen").encode(), dtype=object)
    fragments = ["'save/SaveV2'", "type SaveV2", "signature"]
    expect_error(DENIED, fragments, session_run, ch, "half", {"save/Const:0": prefix}, ["save/control_dependency:0"])
    expect_error(DENIED, fragments, run, ch, "half", {"save/Const:0": prefix}, ["save/control_dependency:0"])
    expect_error(DENIED, ["RestoreV2"], session_run, ch, "half", {"save/Const:0": prefix}, targets=["save/restore_all"])
    # TF2: the saver is a function call in the graph; what it calls is checked too.
    saver = {"saver_filename:0": prefix}
    calls = [f"StatefulPartitionedCall_{i}:0" for i in (6, 7)]  # the export's save and restore functions
    expect_error(DENIED, ["SaveV2"], session_run, ch, "half2", saver, calls[:1])
    expect_error(DENIED, ["RestoreV2", "AssignVariableOp"], session_run, ch, "half2", saver, calls[1:])
    assert list(tmp_path.iterdir()) == []
    np.testing.assert_array_equal(predict_outputs(ch, "half", {"x": X})["y"], 0.5 * X + 2)
    np.testing.assert_array_equal(predict_outputs(ch, "half2", {"x": X[:, 0]})["y"], 0.5 * X[:, 0] + 2)


def test_the_counter_s_signatures_still_change_its_state(daemon):
    ch = daemon.channel
    start = predict_outputs(ch, "counter", {}, signature="get_counter")["output"]
    # Predict on an assigning signature
    assert predict_outputs(ch, "counter", {}, signature="incr_counter")["output"] == start + 1
    by = session_run(ch, "counter", {"delta:0": np.float32(5)}, ["incr_counter_by_op/AssignAdd:0"])[0]
    assert by["incr_counter_by_op/AssignAdd:0"] == start + 6  # its tensors by name, with its own input
    out, _ = run(ch, "counter", {}, ["incr_counter_op/AssignAdd:0"])
    assert out[0] == start + 7
    # Not with a value fed inside the signature, nor through the initializer.
    expect_error(DENIED, ["'incr_counter_op/AssignAdd/value:0' fed", "signature's inputs"],
                 session_run, ch, "counter", {"incr_counter_op/AssignAdd/value:0": np.float32(1000)},
                 ["incr_counter_op/AssignAdd:0"])  # fmt: skip
    expect_error(DENIED, ["'counter/Assign'"], session_run, ch, "counter", {"counter/initial_value:0": np.float32(9)},
                 targets=["counter/Assign"])  # fmt: skip
    assert predict_outputs(ch, "counter", {}, signature="get_counter")["output"] == start + 7
    assert predict_outputs(ch, "counter", {}, signature="reset_counter")["output"] == 0
