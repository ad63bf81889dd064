"""transfer: moving a run's host inputs to its device.

Owns the H2DTransferExecutor interface, the registry of factories keyed by device kind (``cpu``, ``gpu``; and
``auto``), the CPU implementation (no copy where TensorFlow takes the array as it is) and the CuPy (GPU) one,
imported only when a GPU factory is made, and the transfer metrics. It imports neither `server/` nor `executor/`.
"""

from servex.transfer import cpu  # noqa: F401  (registers the "cpu" factory)
from servex.transfer.base import (
    DeviceError,
    H2DTransferExecutor,
    H2DTransferExecutorFactory,
    TransferFuture,
    make_factory,
    register_factory,
)


def _make_gpu_factory(index: int) -> H2DTransferExecutorFactory:
    from servex.transfer.cupy_gpu import CupyTransferExecutorFactory  # CuPy itself is imported only here, lazily

    return CupyTransferExecutorFactory(index)


register_factory("gpu", _make_gpu_factory)

__all__ = [
    "DeviceError",
    "H2DTransferExecutor",
    "H2DTransferExecutorFactory",
    "TransferFuture",
    "make_factory",
    "register_factory",
]
