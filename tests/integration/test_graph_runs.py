"""Runs by tensor name through the client-graph cache: TensorFlow Serving's SessionService/SessionRun and servex's
own servex.v1.GraphExecutor/Run, against TensorFlow Serving's test models, through the real daemon."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import tensorflow as tf

from servex.protos.servex.v1 import graph_executor_pb2, graph_executor_pb2_grpc
from tests.support.clients import expect_error, run, session_run
from tests.support.daemon import metric

X = np.array([[1.0], [2.0], [5.0]], np.float32)


@pytest.fixture(scope="module")
def tf1(graph_daemon):
    """TF1 half_plus_two as hp, TF2's as hp2, and the counter, with a client-graph cache of 2 entries per model:
    the daemon test_graph_run_safety.py shares."""
    return graph_daemon


def test_session_run_by_tensor_names_tf1(tf1):
    values, reply = session_run(tf1.channel, "hp", {"x:0": X}, ["y:0", "y2:0"])
    np.testing.assert_array_equal(values["y:0"], 0.5 * X + 2)
    np.testing.assert_array_equal(values["y2:0"], 0.5 * X + 3)
    assert [t.name for t in reply.tensor] == ["y:0", "y2:0"]
    assert reply.model_spec.version.value == 123


def test_session_run_by_alias(tf1):
    values, _ = session_run(tf1.channel, "hp", {"x": X}, ["y"], alias=True)
    np.testing.assert_array_equal(values["y"], 0.5 * X + 2)
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["'z'", "input alias", "inputs: x"], session_run, tf1.channel, "hp",
                 {"z": X}, ["y"], alias=True)  # fmt: skip


def test_session_run_tf2_by_names_from_the_signature(tf1):
    daemon = tf1
    x = np.array([1.0, 2.0, 5.0], np.float32)
    values, _ = session_run(daemon.channel, "hp2", {"serving_default_x:0": x}, ["StatefulPartitionedCall_5:0"])
    np.testing.assert_array_equal(values["StatefulPartitionedCall_5:0"], [2.5, 3.0, 4.5])
    values, _ = session_run(daemon.channel, "hp2", {"x": x}, ["y"], alias=True, signature="serving_default")
    np.testing.assert_array_equal(values["y"], [2.5, 3.0, 4.5])


def test_session_run_on_the_stateful_counter_model(tf1):
    ch = tf1.channel
    assert session_run(ch, "counter", fetches=["counter:0"])[0]["counter:0"] == 0
    session_run(ch, "counter", targets=["incr_counter_op/AssignAdd"])  # an assign op as a target
    session_run(ch, "counter", targets=["incr_counter_op/AssignAdd"])
    assert session_run(ch, "counter", fetches=["counter:0"])[0]["counter:0"] == 2
    by = session_run(ch, "counter", {"delta:0": np.float32(5)}, ["incr_counter_by_op/AssignAdd:0"])[0]
    assert by["incr_counter_by_op/AssignAdd:0"] == 7  # an assign op as a fetch
    assert session_run(ch, "counter", fetches=["output"], alias=True, signature="incr_counter")[0]["output"] == 8
    assert session_run(ch, "counter", fetches=["reset_counter_op/Assign:0"])[0]["reset_counter_op/Assign:0"] == 0
    assert session_run(ch, "counter", fetches=["output"], alias=True, signature="get_counter")[0]["output"] == 0


def test_permuted_names_share_one_entry_and_answer_the_same(tf1):
    x2 = np.array([[4.0]], np.float32)
    feeds_a = {"x:0": X[:1], "x2:0": x2}
    feeds_b = {"x2:0": x2, "x:0": X[:1]}
    builds = metric(tf1, "servex_client_graph_builds_total", model="hp")
    first, reply = run(tf1.channel, "hp", feeds_a, ["y:0", "y3:0"])
    second, _ = run(tf1.channel, "hp", feeds_b, ["y3:0", "y:0"])
    assert reply.client_graph_key == "x2:0-x:0^y3:0-y:0^"
    np.testing.assert_array_equal(first[0], second[1])  # outputs come back in each caller's order
    np.testing.assert_array_equal(first[1], second[0])
    np.testing.assert_array_equal(first[1], 0.5 * x2 + 3)
    assert metric(tf1, "servex_client_graph_builds_total", model="hp") == builds + 1


def test_explicit_graph_name(tf1):
    out, reply = run(tf1.channel, "hp", {"x:0": X}, ["y:0"], graph_name="half")
    np.testing.assert_array_equal(out[0], 0.5 * X + 2)
    out, _ = run(tf1.channel, "hp", {"x:0": X}, ["y:0"], graph_name="half")
    np.testing.assert_array_equal(out[0], 0.5 * X + 2)
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["'half'", "fetches ['y:0']", "fetches ['y2:0']"],
                 run, tf1.channel, "hp", {"x:0": X}, ["y2:0"], graph_name="half")  # fmt: skip


def test_concurrent_first_calls_build_once(tf1):
    builds = metric(tf1, "servex_client_graph_builds_total", model="hp")
    barrier = threading.Barrier(12)
    results, errors = [], []

    def call():
        channel = grpc.insecure_channel(tf1.address)
        barrier.wait(30)
        try:
            results.append(run(channel, "hp", {"x:0": X}, ["y2:0"], graph_name="concurrent")[0][0])
        except grpc.RpcError as e:
            errors.append(e)
        channel.close()

    threads = [threading.Thread(target=call) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 12
    for r in results:
        np.testing.assert_array_equal(r, 0.5 * X + 3)
    assert metric(tf1, "servex_client_graph_builds_total", model="hp") == builds + 1


def test_eviction_under_a_small_bound_rebuilds_correctly(tf1):
    evictions = metric(tf1, "servex_client_graph_cache_evictions_total", model="hp")
    keys = [({"x:0": X}, ["y:0"]), ({"x:0": X}, ["y2:0"]), ({"x:0": X}, ["y:0", "y2:0"])]
    for feeds, fetches in keys:
        run(tf1.channel, "hp", feeds, fetches)
    assert metric(tf1, "servex_client_graph_cache_evictions_total", model="hp") >= evictions + 1
    builds = metric(tf1, "servex_client_graph_builds_total", model="hp")
    out, _ = run(tf1.channel, "hp", {"x:0": X}, ["y:0"])  # evicted: built again, and right
    np.testing.assert_array_equal(out[0], 0.5 * X + 2)
    assert metric(tf1, "servex_client_graph_builds_total", model="hp") == builds + 1
    assert metric(tf1, "servex_client_graph_cache_entries", model="hp") >= 2
    for name in [
        "servex_client_graph_cache_hits_total",
        "servex_client_graph_cache_misses_total",
        "servex_client_graph_builds_total",
        "servex_client_graph_build_seconds_count",
        "servex_client_graph_cache_evictions_total",
        "servex_client_graph_cache_entries",
    ]:
        assert metric(tf1, name, model="hp") > 0, name


def test_errors_name_what_was_wrong(tf1):
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["'x:1'", "did you mean", "'x:0'"],
                 run, tf1.channel, "hp", {"x:1": X}, ["y:0"])  # fmt: skip
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["'yy:0'", "did you mean", "'y:0'"],
                 run, tf1.channel, "hp", {"x:0": X}, ["yy:0"])  # fmt: skip
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["model 'hp' version 123: ", "'incr_op'", "no such operation"],
                 run, tf1.channel, "hp", {"x:0": X}, [], ["incr_op"])  # fmt: skip
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["nothing to run"], run, tf1.channel, "hp", {"x:0": X}, [])
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["'x:0'", "float32", "float64"],
                 run, tf1.channel, "hp", {"x:0": X.astype(np.float64)}, ["y:0"])  # fmt: skip
    expect_error(grpc.StatusCode.NOT_FOUND, ["'nope'"], run, tf1.channel, "nope", {"x:0": X}, ["y:0"])
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["model.name is empty"], run, tf1.channel, "", {"x:0": X}, ["y:0"])
    both = graph_executor_pb2.RunRequest(fetches=["y:0"])
    both.model.name, both.model.version, both.model.version_label = "hp", 999, "stable"
    both.feeds["x:0"].CopyFrom(tf.make_tensor_proto(X))
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ["'hp'", "version 999 and version_label 'stable'", "give one"],
                 graph_executor_pb2_grpc.GraphExecutorStub(tf1.channel).Run, both, timeout=30)  # fmt: skip
    out, _ = run(tf1.channel, "hp", {"x:0": X}, ["y:0"])  # still serving
    np.testing.assert_array_equal(out[0], 0.5 * X + 2)
