"""The CPU transfer executor (no copy) and the registry that picks a factory by device string."""

from __future__ import annotations

import numpy as np
import pytest

from transfer import H2DTransferExecutor, H2DTransferExecutorFactory, TransferFuture, make_factory
from transfer.cpu import CpuTransferExecutorFactory


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_cpu_factory_is_a_passthrough():
    factory = make_factory("cpu")
    assert isinstance(factory, CpuTransferExecutorFactory)
    assert isinstance(factory, H2DTransferExecutorFactory)
    assert factory.device == "cpu"
    assert factory.passthrough is True
    assert isinstance(factory.create(), H2DTransferExecutor)


@pytest.mark.parametrize("device", ["cpu:0", "cpu:3"])
def test_cpu_with_an_index(device):
    factory = make_factory(device)
    assert isinstance(factory, CpuTransferExecutorFactory)
    assert factory.passthrough is True


def test_cpu_executor_returns_the_very_same_arrays():
    executor = make_factory("cpu").create()
    arrays = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([b"a", b"bc"], dtype=object),
        np.zeros((0, 5), np.int64),
        np.arange(10, dtype=np.int32)[::2],  # a strided view: no contiguous copy either
    ]
    before = [address(a) for a in arrays]
    futures = [executor.schedule(a) for a in arrays]
    assert all(isinstance(f, TransferFuture) for f in futures)
    assert executor.run() is None
    for array, future, addr in zip(arrays, futures, before, strict=True):
        result = future.result()
        assert result is array
        assert address(result) == addr


def test_every_run_gets_a_working_executor():
    factory = make_factory("cpu")
    for _ in range(3):
        executor = factory.create()
        a = np.ones(3)
        future = executor.schedule(a)
        executor.run()
        assert future.result() is a


@pytest.mark.parametrize("device", ["tpu", "cpu:x", "cpu:-1", "tpu:0", "CPU", ""])
def test_unknown_device_names_the_known_kinds(device):
    with pytest.raises(ValueError) as info:
        make_factory(device)
    message = str(info.value)
    assert repr(device) in message
    assert "'cpu'" in message


def test_transfer_future():
    future = TransferFuture()
    assert future.result() is None
    value = np.ones(2)
    future.set(value)
    assert future.result() is value
    assert TransferFuture(value).result() is value
