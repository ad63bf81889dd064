"""The CPU transfer executor: host arrays reach TensorFlow without a copy wherever TensorFlow would take them as
they are, and with exactly one (faster) copy where TensorFlow would copy them itself.

What TensorFlow does with a fed NumPy array (measured with TF 2.21, x86-64; tests/transfer/test_cpu_tensorflow.py
checks it through a real session callable, as executor/graph_executor.py builds them): it wraps the array's
buffer without copying when the buffer is C-contiguous and aligned to EIGEN_MAX_ALIGN_BYTES (64); otherwise
``PyArray_FromAny`` makes it contiguous and ``TF_NewTensor`` copies it into a fresh 64-byte-aligned buffer.
Arrays decoded from ``tensor_content`` (``np.frombuffer`` over a ``bytes`` object) start 32 bytes into the object,
so they are never 64-byte aligned once they are large (malloc'd at page + 16: address % 64 == 48): TensorFlow
always copies them, and its copy into freshly faulted 4 KiB pages costs ~46 ms for 64 MiB, where a NumPy copy into
a fresh buffer (NumPy asks the kernel for huge pages) costs ~12 ms. So this executor passes aligned contiguous
arrays through untouched and copies unaligned or strided ones of ALIGN_COPY_MIN_BYTES or more into a 64-byte
aligned NumPy buffer itself, which TensorFlow then takes without a copy: still one copy, three times faster at
64 MiB. Smaller ones are left to TensorFlow, whose copy is as cheap as ours below ~1 MiB.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from servex.transfer.base import H2DTransferExecutor, H2DTransferExecutorFactory, TransferFuture, register_factory
from servex.transfer.metrics import TransferMetrics

# EIGEN_MAX_ALIGN_BYTES of TensorFlow's x86-64 builds: TF_NewTensor copies a buffer not aligned to it.
ALIGNMENT = 64
# Below this, TensorFlow's own copy of an unaligned input costs no more than ours.
ALIGN_COPY_MIN_BYTES = 1 << 20
# Arrays TensorFlow converts element by element (strings), where a byte copy would not help.
_NOT_BYTES = frozenset("OSU")


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def needs_aligned_copy(array: np.ndarray) -> bool:
    """Whether TensorFlow would copy this array when it is fed (not C-contiguous, or not 64-byte aligned)."""
    if array.dtype.kind in _NOT_BYTES:
        return False
    return not array.flags.c_contiguous or address(array) % ALIGNMENT != 0


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``array`` whose buffer is aligned to ALIGNMENT bytes."""
    raw = np.empty(array.nbytes + ALIGNMENT, np.uint8)
    start = -address(raw) % ALIGNMENT
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    np.copyto(out, array, casting="no")
    return out


def to_tensorflow_layout(arrays: Sequence[np.ndarray], metrics: TransferMetrics) -> Sequence[np.ndarray]:
    """The arrays as TensorFlow takes them without a copy (``arrays`` itself when none needs a copy, the usual
    case); records the metrics."""
    nbytes = 0
    for array in arrays:
        n = array.nbytes
        if n >= ALIGN_COPY_MIN_BYTES and needs_aligned_copy(array):
            return _with_aligned_copies(arrays, metrics)
        nbytes += n
    metrics.bytes.inc(nbytes)
    metrics.seconds.observe(0.0)
    return arrays


def _with_aligned_copies(arrays: Sequence[np.ndarray], metrics: TransferMetrics) -> list[np.ndarray]:
    start = time.perf_counter()
    out = [aligned_copy(a) if a.nbytes >= ALIGN_COPY_MIN_BYTES and needs_aligned_copy(a) else a for a in arrays]
    metrics.bytes.inc(sum(a.nbytes for a in arrays))
    metrics.seconds.observe(time.perf_counter() - start)
    return out


class CpuTransferExecutor(H2DTransferExecutor):
    """One run's CPU transfers: futures hold the arrays themselves, or their aligned copies after ``run()``."""

    def __init__(self, metrics: TransferMetrics, device: str = "cpu"):
        self.device = device
        self._metrics = metrics
        self._arrays: list[np.ndarray] = []
        self._futures: list[TransferFuture] = []

    def schedule(self, array: np.ndarray, device: str | None = None) -> TransferFuture:
        self._check_device(device)
        future = TransferFuture(array)
        self._arrays.append(array)
        self._futures.append(future)
        return future

    def run(self) -> None:
        for future, value in zip(self._futures, to_tensorflow_layout(self._arrays, self._metrics), strict=True):
            future.set(value)
        self._arrays, self._futures = [], []


class CpuTransferExecutorFactory(H2DTransferExecutorFactory):
    device = "cpu"  # device tensors are host NumPy arrays

    def __init__(self, index: int = 0):
        self.device = "cpu" if index == 0 else f"cpu:{index}"
        self.metrics = TransferMetrics(self.device)

    def create(self) -> H2DTransferExecutor:
        return CpuTransferExecutor(self.metrics, self.device)

    def transfer(self, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """The whole run in one call, without futures: the per-run cost is a couple of microseconds."""
        return to_tensorflow_layout(arrays, self.metrics)


register_factory("cpu", CpuTransferExecutorFactory)
