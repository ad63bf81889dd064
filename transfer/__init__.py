"""transfer: moving a run's host inputs to its device.

Owns the H2DTransferExecutor interface, the registry of factories keyed by device kind, and the CPU
implementation (no copy). It imports neither `server/` nor `executor/`.
"""

from transfer import cpu  # noqa: F401  (registers the "cpu" factory)
from transfer.base import (
    H2DTransferExecutor,
    H2DTransferExecutorFactory,
    TransferFuture,
    make_factory,
    register_factory,
)

__all__ = ["H2DTransferExecutor", "H2DTransferExecutorFactory", "TransferFuture", "make_factory", "register_factory"]
