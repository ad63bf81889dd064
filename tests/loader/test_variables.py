"""The restore registry, the loaded-variable registry and a version's variable store (real TensorFlow)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from executor import GraphExecutor
from loader import load_saved_model
from loader.errors import InvalidArgument, NotFound
from loader.variables import ON_DEVICE, RESTORE_POOL, UNRESTORED, AlreadyExists, LoadedVariableRegistry, RestoreRegistry
from tests.conftest import HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2


def test_register_is_idempotent_for_an_equal_spec_and_refuses_another():
    registry = RestoreRegistry()
    first = registry.register("w", np.float32, (2, 3), lambda: np.zeros((2, 3), np.float32))
    assert registry.register("w", np.dtype("float32"), [2, 3], lambda: None) is first
    with pytest.raises(AlreadyExists) as info:
        registry.register("w", np.float64, (2, 3), lambda: None)
    assert info.value.code == "ALREADY_EXISTS"
    assert "float32[2, 3]" in info.value.message and "float64[2, 3]" in info.value.message
    with pytest.raises(AlreadyExists, match=r"float32\[3, 2\]"):
        registry.register("w", np.float32, (3, 2), lambda: None)
    with pytest.raises(NotFound, match="'nope'"):
        registry.restore("nope")


def test_concurrent_restores_read_once():
    reads = []
    gate = threading.Event()

    def read():
        reads.append(1)
        gate.wait(5)
        return np.arange(6, dtype=np.float32).reshape(2, 3)

    registry = RestoreRegistry()
    registry.register("w", np.float32, (2, 3), read)
    assert registry.state("w") == UNRESTORED
    futures = [RESTORE_POOL.submit(registry.restore, "w") for _ in range(2)]
    futures += [RESTORE_POOL.submit(registry.restore, "w") for _ in range(6)]
    gate.set()
    values = [f.result(10).result(10) for f in futures]
    assert len(reads) == 1
    for value in values:
        np.testing.assert_array_equal(value, np.arange(6).reshape(2, 3))
    assert registry.state("w") == "RESTORED"


def test_a_read_that_disagrees_with_the_index_fails_and_may_be_retried():
    registry = RestoreRegistry()
    registry.register("w", np.float32, (2,), lambda: np.zeros(3, np.float32))
    with pytest.raises(InvalidArgument, match=r"float32\[3\].*float32\[2\]"):
        registry.restore("w").result()
    assert registry.state("w") == UNRESTORED


def test_loaded_variable_registry_places_once_per_device():
    calls = []
    registry = LoadedVariableRegistry()
    futures = [registry.get_or_place("w", "cpu", lambda: calls.append("cpu")) for _ in range(5)]
    futures.append(registry.get_or_place("w", "gpu:0", lambda: calls.append("gpu")))
    for f in futures:
        f.result(10)
    assert sorted(calls) == ["cpu", "gpu"]
    assert registry.placed("w", "cpu") and registry.placed("w", "gpu:0") and not registry.placed("v", "cpu")


@pytest.mark.parametrize("path", [HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2], ids=["tf1", "tf2"])
def test_store_restores_lazily_and_assigns(path):
    model = load_saved_model(str(path / "00000123"))
    try:
        store = model.variables
        assert {state for _, state in store.listing()} == {UNRESTORED}
        ready = store.ensure(["a"])
        ready.result(30)
        assert store.state("a") == ON_DEVICE and store.state("b") == UNRESTORED
        assert store.ensure(["a"]) is None  # already there
        store.assign("a", np.float32(4.0))
        sig = model.signatures["serving_default"]
        x = np.ones((1, 1) if path == HALF_PLUS_TWO_TF1 else (1,), np.float32)
        y = GraphExecutor(model).run({sig.inputs["x"].name: x}, [sig.outputs["y"].name])[0]
        assert y.ravel().tolist() == [6.0]  # a * x + b, with a replaced
        with pytest.raises(InvalidArgument, match=r"float32\[\].*float64\[\]"):
            store.assign("a", np.float64(1.0))
        with pytest.raises(NotFound, match="'zz'"):
            store.assign("zz", np.float32(1.0))
    finally:
        model.close()


def test_eager_restore_puts_everything_on_the_device():
    model = load_saved_model(str(HALF_PLUS_TWO_TF1 / "00000123"), lazy_restore=False)
    try:
        assert {state for _, state in model.variables.listing()} == {ON_DEVICE}
    finally:
        model.close()
