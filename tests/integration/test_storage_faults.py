"""Failing storage under lazy restoration, with the real daemon: a variable's data file removed, truncated,
unreadable (EACCES on open) or failing (EIO on read, from a preloaded shim: tests/support/faults.c) while a model
serves. The calls whose graphs need an unread variable get INTERNAL naming the variable and the file; graphs whose
variables are in keep serving; once the file is back, the next call reads the variable and serves."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.support import faults
from tests.support.daemon import Daemon

pytestmark = pytest.mark.integration

KINDS = ("removed", "truncated", "unreadable", "eio")


@pytest.fixture(scope="module")
def five_tables(tmp_path_factory):
    """A SavedModel whose signatures each read their own variable: ``serving_default`` reads v_ok, ``removed``
    v_removed, and so on; y = x * v."""
    module = tf.Module()
    names = ("ok", *KINDS)
    for i, name in enumerate(names):
        setattr(module, f"v_{name}", tf.Variable(np.full(3, i + 1, np.float32), name=f"v_{name}"))

    def signature(variable):
        return tf.function(lambda x: {"y": x * variable}, input_signature=[tf.TensorSpec([None, 3], tf.float32)])

    signatures = {("serving_default" if n == "ok" else n): signature(getattr(module, f"v_{n}")) for n in names}
    base = tmp_path_factory.mktemp("five_tables")
    tf.saved_model.save(module, str(base / "1"), signatures=signatures)
    return base


def _predict(daemon, signature: str):
    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = "tables", signature
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((1, 3), np.float32)))
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    return tf.make_ndarray(stub.Predict(request, timeout=60).outputs["y"])


def _refused(daemon, signature: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        _predict(daemon, signature)
    assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
    return info.value.details()


def test_each_storage_fault_fails_only_the_graphs_that_need_the_variable_and_heals(five_tables, tmp_path, monkeypatch):
    data = next((five_tables / "1" / "variables").glob("variables.data-*"))
    saved = tmp_path / "saved-data"
    shutil.copyfile(data, saved)
    switch = faults.Switch(data.name)
    for key, value in switch.environment(faults.build(tmp_path)).items():
        monkeypatch.setenv(key, value)  # a fresh process (not a spare): the shim loads at its start
    daemon = Daemon([f"--model_base_path={five_tables}", "--model_name=tables"], tmp_path)
    try:
        daemon.wait_serving()
        for key in ("LD_PRELOAD", "SERVEX_FAULT_PATH", "SERVEX_FAULT_SWITCH"):
            monkeypatch.delenv(key)
        np.testing.assert_array_equal(_predict(daemon, "serving_default"), [[1, 1, 1]])  # v_ok is in
        breaks = {
            "removed": (lambda: data.unlink(), lambda: shutil.copyfile(saved, data)),
            "truncated": (lambda: data.write_bytes(saved.read_bytes()[:8]), lambda: shutil.copyfile(saved, data)),
            "unreadable": (lambda: switch.on("eacces"), lambda: switch.off("eacces")),
            "eio": (lambda: switch.on("eio"), lambda: switch.off("eio")),
        }
        for i, kind in enumerate(KINDS, start=2):
            fault, fix = breaks[kind]
            fault()
            message = _refused(daemon, kind)
            assert f"v_{kind}" in message and data.name in message, (kind, message)
            np.testing.assert_array_equal(_predict(daemon, "serving_default"), [[1, 1, 1]])  # the others serve
            assert _refused(daemon, kind)  # still failing: tried again, not remembered as read
            fix()
            np.testing.assert_array_equal(_predict(daemon, kind), [[i, i, i]])  # read once the file is back
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()
