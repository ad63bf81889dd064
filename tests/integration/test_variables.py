"""Lazy tensor restoration and the admin VariableService, through the real daemon: a model with a cold table
(read only by serving_default) and a scalar (read only by calibrate), exported here with TensorFlow."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import tensorflow as tf

from servex.protos.servex.v1 import variables_pb2, variables_pb2_grpc
from tests.support.clients import admin_stub, predict_first
from tests.support.daemon import metric, run_to_exit

ROWS, WIDTH = 20_000, 16
TWO = {"x": np.array([2.0], np.float32)}  # calibrate's input


@pytest.fixture(scope="module")
def cold_model(tmp_path_factory):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    w = rng.standard_normal((WIDTH, 1)).astype(np.float32)

    class Cold(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table, name="table")
            self.w = tf.Variable(w, name="w")
            self.scale = tf.Variable(1.5, name="scale")

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int64, name="ids")])
        def serve(self, ids):
            return {"score": tf.matmul(tf.reduce_mean(tf.nn.embedding_lookup(self.table, ids), axis=1), self.w)}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def calibrate(self, x):
            return {"y": x * self.scale}

    base = tmp_path_factory.mktemp("cold")
    module = Cold()
    tf.saved_model.save(
        module, str(base / "1"), signatures={"serving_default": module.serve, "calibrate": module.calibrate}
    )
    return base, table, w


def expected_score(table, w, ids):
    return table[ids].mean(axis=1) @ w


def states(stub, metadata=None):
    req = variables_pb2.ListVariablesRequest()
    req.model.name = "cold"
    reply = stub.ListVariables(req, timeout=10, metadata=metadata)
    return {v.name: variables_pb2.Variable.State.Name(v.state) for v in reply.variables}, reply


@pytest.fixture(scope="module")
def lazy(cold_model, start_daemon):
    daemon = start_daemon(f"--model_base_path={cold_model[0]}", "--model_name=cold", port_flags=["--admin_port"])
    return daemon, daemon.admin_port


def test_calibrate_answers_while_the_table_stays_unrestored(lazy):
    daemon, admin = lazy
    stub = admin_stub(admin)
    before, reply = states(stub)
    assert before == {"table": "UNRESTORED", "w": "UNRESTORED", "scale": "UNRESTORED"}
    table = next(v for v in reply.variables if v.name == "table")
    assert list(table.shape) == [ROWS, WIDTH] and table.bytes == ROWS * WIDTH * 4 and table.dtype == 1
    assert table.checkpoint_key == "table/.ATTRIBUTES/VARIABLE_VALUE"
    np.testing.assert_allclose(predict_first(daemon.channel, "cold", TWO, signature="calibrate"), [3.0])
    after, _ = states(stub)
    assert after == {"table": "UNRESTORED", "w": "UNRESTORED", "scale": "ON_DEVICE"}
    assert metric(daemon, "servex_restored_variable_bytes", model="cold") == 4


def test_concurrent_first_calls_restore_the_table_once(lazy, cold_model):
    daemon, admin = lazy
    _, table, w = cold_model
    ids = np.array([[1, 2, 3, 4], [19_999, 0, 7, 7]], np.int64)
    restores_before = metric(daemon, "servex_variable_restore_seconds_count", model="cold")
    barrier, results, errors = threading.Barrier(10), [], []

    def call():
        channel = grpc.insecure_channel(daemon.address)
        barrier.wait(30)
        try:
            results.append(predict_first(channel, "cold", {"ids": ids}, signature="serving_default"))
        except grpc.RpcError as e:
            errors.append(e)
        channel.close()

    threads = [threading.Thread(target=call) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 10
    for r in results:
        np.testing.assert_allclose(r, expected_score(table, w, ids), rtol=1e-5)
    # table and w, read from the checkpoint once, together (one restore for the client graph that needs both)
    assert metric(daemon, "servex_variable_restore_seconds_count", model="cold") == restores_before + 1
    assert states(admin_stub(admin))[0] == {"table": "ON_DEVICE", "w": "ON_DEVICE", "scale": "ON_DEVICE"}
    assert metric(daemon, "servex_restored_variable_bytes", model="cold") == ROWS * WIDTH * 4 + WIDTH * 4 + 4


def _assign(stub, name, value, metadata=None):
    req = variables_pb2.AssignVariableRequest(name=name)
    req.model.name = "cold"
    req.value.CopyFrom(tf.make_tensor_proto(value))
    return stub.AssignVariable(req, timeout=30, metadata=metadata)


def test_assign_variable_changes_the_answer_and_refuses_mismatches(lazy):
    daemon, admin = lazy
    stub = admin_stub(admin)
    reply = _assign(stub, "scale", np.float32(4.0))
    assert reply.variable.name == "scale" and reply.model.version == 1
    np.testing.assert_allclose(predict_first(daemon.channel, "cold", TWO, signature="calibrate"), [8.0])
    assert metric(daemon, "servex_variable_assignments_total", model="cold") == 1
    for bad, fragments in [
        (np.float64(4.0), ["float32[]", "float64[]"]),
        (np.ones(2, np.float32), ["float32[]", "float32[2]"]),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            _assign(stub, "scale", bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(f in info.value.details() for f in fragments), info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        _assign(stub, "nope", np.float32(1))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "scale" in info.value.details()
    # A version and a label together: refused, not the label's version changed instead of the one named.
    both = variables_pb2.AssignVariableRequest(name="scale")
    both.model.name, both.model.version, both.model.version_label = "cold", 7, "stable"
    both.value.CopyFrom(tf.make_tensor_proto(np.float32(1)))
    with pytest.raises(grpc.RpcError) as info:
        stub.AssignVariable(both, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "version 7 and version_label 'stable'" in info.value.details()
    both.model.ClearField("version_label")
    both.model.ClearField("name")
    with pytest.raises(grpc.RpcError) as info:
        stub.AssignVariable(both, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model.name is empty" in info.value.details()
    np.testing.assert_allclose(predict_first(daemon.channel, "cold", TWO, signature="calibrate"), [8.0])


def test_runs_during_assignments_see_the_old_or_the_new_value_never_a_mix(lazy, cold_model):
    daemon, admin = lazy
    _, table, w = cold_model
    stub = admin_stub(admin)
    ids = np.array([[5, 6, 7, 8]], np.int64)
    w_a, w_b = np.ones((WIDTH, 1), np.float32), np.full((WIDTH, 1), 3.0, np.float32)
    allowed = [expected_score(table, v, ids) for v in (w, w_a, w_b)]  # as exported, then the two assigned
    stop, seen, errors = threading.Event(), [], []

    def reader():
        channel = grpc.insecure_channel(daemon.address)
        while not stop.is_set():
            try:
                seen.append(predict_first(channel, "cold", {"ids": ids}, signature="serving_default"))
            except grpc.RpcError as e:
                errors.append(e)
        channel.close()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(10):
            _assign(stub, "w", w_a if i % 2 else w_b)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    _assign(stub, "w", w)  # leave the model as exported
    assert errors == [] and seen
    for value in seen:
        assert any(np.allclose(value, a, rtol=1e-5) for a in allowed), value


def test_admin_service_is_not_on_the_public_port(lazy):
    daemon, _ = lazy
    with pytest.raises(grpc.RpcError) as info:
        states(variables_pb2_grpc.VariableServiceStub(daemon.channel))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_eager_restore_and_prefetch(cold_model, start_daemon, tmp_path):
    base = cold_model[0]
    admin = ["--admin_port"]
    # Both start at once; each is waited for before its checks.
    eager = start_daemon(f"--model_base_path={base}", "--model_name=cold", "--lazy_restore=false", port_flags=admin,
                         wait=False)  # fmt: skip
    prefetching = start_daemon(f"--model_base_path={base}", "--model_name=cold", "--prefetch_variables=cold=table",
                               port_flags=admin, wait=False)  # fmt: skip
    assert set(states(admin_stub(eager.wait_serving().admin_port))[0].values()) == {"ON_DEVICE"}
    stub = admin_stub(prefetching.wait_serving().admin_port)
    req = variables_pb2.PrefetchRequest(names=["w"], wait=True)
    req.model.name = "cold"
    assert [variables_pb2.Variable.State.Name(v.state) for v in stub.Prefetch(req, timeout=30).variables] == [
        "ON_DEVICE"
    ]
    deadline = threading.Event()
    for _ in range(100):
        if states(stub)[0]["table"] == "ON_DEVICE":
            break
        deadline.wait(0.1)
    assert states(stub)[0] == {"table": "ON_DEVICE", "w": "ON_DEVICE", "scale": "UNRESTORED"}


def test_admin_token(cold_model, start_daemon, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    daemon = start_daemon(f"--model_base_path={cold_model[0]}", "--model_name=cold", f"--admin_token_file={token}",
                          port_flags=["--admin_port"])  # fmt: skip
    stub = admin_stub(daemon.admin_port)
    for metadata in (None, (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as info:
            states(stub, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert states(stub, (("authorization", "Bearer s3cret"),))[0]["table"] == "UNRESTORED"


def test_admin_off_loopback_needs_a_token(cold_model):
    out = run_to_exit([f"--model_base_path={cold_model[0]}", "--admin_port=1", "--admin_bind_address=0.0.0.0"])
    assert out.returncode != 0 and "--admin_token_file" in out.stderr
