"""The CPU transfer executor: host arrays already are CPU tensors, so nothing is copied."""

from __future__ import annotations

import numpy as np

from transfer.base import H2DTransferExecutor, H2DTransferExecutorFactory, TransferFuture, register_factory


class CpuTransferExecutor(H2DTransferExecutor):
    def schedule(self, array: np.ndarray) -> TransferFuture:
        return TransferFuture(array)

    def run(self) -> None:
        return None


class CpuTransferExecutorFactory(H2DTransferExecutorFactory):
    device = "cpu"
    passthrough = True

    def __init__(self, index: int = 0):
        self._executor = CpuTransferExecutor()  # stateless, so one serves every run

    def create(self) -> H2DTransferExecutor:
        return self._executor


register_factory("cpu", CpuTransferExecutorFactory)
