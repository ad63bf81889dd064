"""The CPU transfer executor (no copy where TensorFlow takes an array as it is; one aligned copy where it would
copy anyway), its metrics, and the registry that picks a factory by device string."""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import pytest
from prometheus_client import REGISTRY

from servex.transfer import DeviceError, H2DTransferExecutor, H2DTransferExecutorFactory, TransferFuture, make_factory
from servex.transfer.cpu import (
    ALIGNMENT,
    CpuTransferExecutorFactory,
    aligned_copy,
    needs_aligned_copy,
)
from tests.support.buffers import BIG, address, unaligned
from tests.transfer.gpu import without_gpu


def sample(name: str, device: str = "cpu") -> float:
    return REGISTRY.get_sample_value(name, {"device": device}) or 0.0


def test_cpu_factory():
    factory = make_factory("cpu")
    assert isinstance(factory, CpuTransferExecutorFactory)
    assert isinstance(factory, H2DTransferExecutorFactory)
    assert factory.device == "cpu"
    assert isinstance(factory.create(), H2DTransferExecutor)


@pytest.mark.parametrize("device", ["cpu:0", "cpu:3"])
def test_cpu_with_an_index(device):
    factory = make_factory(device)
    assert isinstance(factory, CpuTransferExecutorFactory)
    assert factory.device.startswith("cpu")


def test_cpu_executor_returns_the_very_same_arrays():
    executor = make_factory("cpu").create()
    arrays = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([b"a", b"bc"], dtype=object),
        np.zeros((0, 5), np.int64),
        np.arange(10, dtype=np.int32)[::2],  # small and strided: TensorFlow's own copy is as cheap as ours
        unaligned(100),  # small and unaligned: likewise
    ]
    before = [address(a) for a in arrays]
    futures = [executor.schedule(a) for a in arrays]
    assert all(isinstance(f, TransferFuture) for f in futures)
    assert executor.run() is None
    for array, future, addr in zip(arrays, futures, before, strict=True):
        result = future.result()
        assert result is array
        assert address(result) == addr


def test_transfer_returns_the_callers_list_when_nothing_is_copied():
    factory = make_factory("cpu")
    arrays = [np.ones(3, np.float32), aligned_copy(np.ones(BIG * 4, np.float32))]
    assert address(arrays[1]) % ALIGNMENT == 0
    assert factory.transfer(arrays) is arrays


@pytest.mark.parametrize(
    "make",
    [
        lambda: unaligned(BIG),
        lambda: unaligned(2 * BIG, np.float16),
        lambda: unaligned(2 * BIG, ml_dtypes.bfloat16),
        lambda: np.arange(2 * BIG, dtype=np.float32).reshape(BIG, 2)[:, 0],  # strided
        lambda: _unaligned_frombuffer(BIG),  # as server/transport/tensors.py decodes tensor_content
    ],
    ids=["float32", "float16", "bfloat16", "strided", "frombuffer-bytes"],
)
def test_large_unaligned_or_strided_arrays_get_one_aligned_copy(make):
    array = make()
    assert needs_aligned_copy(array)
    factory = make_factory("cpu")
    executor = factory.create()
    future = executor.schedule(array)
    executor.run()
    out = future.result()
    assert out is not array
    assert address(out) % ALIGNMENT == 0 and out.flags.c_contiguous
    assert out.dtype == array.dtype and out.shape == array.shape
    np.testing.assert_array_equal(out.view(np.uint8) if out.dtype.kind == "V" else out, _bytes_or(array))
    assert not needs_aligned_copy(out)
    assert factory.transfer([out])[0] is out  # already aligned: passed through


def _unaligned_frombuffer(count: int) -> np.ndarray:
    """float32 values read with np.frombuffer from a bytes object, at an offset that is not 64-byte aligned
    (where a bytes object's data lands is up to the allocator, so the offset is chosen, not assumed)."""
    data = np.arange(count + 32, dtype=np.float32).tobytes()
    base = address(np.frombuffer(data, np.uint8))
    offset = next(o for o in range(4, 128, 4) if (base + o) % ALIGNMENT)
    return np.frombuffer(data, np.float32, count=count, offset=offset)


def _bytes_or(array):
    return np.ascontiguousarray(array).view(np.uint8) if array.dtype.kind == "V" else array


def test_only_the_arrays_that_need_it_are_copied():
    small, aligned_big, unaligned_big = np.ones(4, np.float32), aligned_copy(np.ones(BIG, np.float32)), unaligned(BIG)
    out = make_factory("cpu").transfer([small, aligned_big, unaligned_big])
    assert out[0] is small and out[1] is aligned_big
    assert out[2] is not unaligned_big and address(out[2]) % ALIGNMENT == 0
    np.testing.assert_array_equal(out[2], unaligned_big)


def test_strings_are_never_byte_copied():
    strings = np.array([b"x" * 64] * (BIG // 8), dtype=object)
    assert not needs_aligned_copy(strings)
    assert make_factory("cpu").transfer([strings])[0] is strings
    fixed = np.array(["abc"] * BIG, dtype="U3")[::2]
    assert not needs_aligned_copy(fixed)


def test_metrics_count_bytes_and_runs():
    factory = make_factory("cpu")
    bytes_before = sample("servex_h2d_bytes_total")
    runs_before = sample("servex_h2d_transfer_seconds_count")
    factory.transfer([np.ones(3, np.float32), np.ones((2, 5), np.int64)])
    executor = factory.create()
    executor.schedule(np.ones(7, np.int8))
    executor.run()
    factory.transfer([unaligned(BIG)])
    assert sample("servex_h2d_bytes_total") - bytes_before == 12 + 80 + 7 + BIG * 4
    assert sample("servex_h2d_transfer_seconds_count") - runs_before == 3


def test_a_run_without_a_copy_is_observed_as_zero_seconds():
    factory = make_factory("cpu")
    labels = {"device": "cpu", "le": "1e-06"}
    before = REGISTRY.get_sample_value("servex_h2d_transfer_seconds_bucket", labels) or 0.0
    factory.transfer([np.ones(3, np.float32)])
    assert REGISTRY.get_sample_value("servex_h2d_transfer_seconds_bucket", labels) - before == 1


def test_every_run_gets_a_working_executor():
    factory = make_factory("cpu")
    for _ in range(3):
        executor = factory.create()
        a = np.ones(3)
        future = executor.schedule(a)
        executor.run()
        assert future.result() is a


def test_an_executor_refuses_another_device():
    executor = make_factory("cpu").create()
    executor.schedule(np.ones(1), device="cpu")
    with pytest.raises(DeviceError, match="targets 'cpu', not 'gpu:0'"):
        executor.schedule(np.ones(1), device="gpu:0")


@pytest.mark.parametrize("device", ["tpu", "cpu:x", "cpu:-1", "tpu:0", "CPU", "", "cpu:", "gpu:one"])
def test_unknown_device_names_the_known_kinds(device):
    with pytest.raises(DeviceError) as info:
        make_factory(device)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert repr(device) in message
    assert "'cpu'" in message and "'gpu'" in message and "'auto'" in message


@without_gpu
def test_auto_falls_back_to_cpu_and_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="servex.transfer.base"):
        factory = make_factory("auto")
    assert isinstance(factory, CpuTransferExecutorFactory)
    assert "--device=auto" in caplog.text and "falling back to cpu" in caplog.text
    assert "gpu:0" in caplog.text


@without_gpu
def test_gpu_without_cupy_or_cuda_says_what_is_missing():
    with pytest.raises(DeviceError) as info:
        make_factory("gpu:0")
    message = str(info.value)
    assert message.startswith("--device=gpu:0")
    assert "CuPy" in message or "CUDA" in message


def test_transfer_future():
    future = TransferFuture()
    assert future.result() is None
    value = np.ones(2)
    future.set(value)
    assert future.result() is value
    assert TransferFuture(value).result() is value
