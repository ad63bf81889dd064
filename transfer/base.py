"""The H2DTransferExecutor contract and the registry of factories that make them.

Per run, the executor asks the device's factory for a fresh H2DTransferExecutor, ``schedule``s every host input
on it (each call returns a future), calls ``run()`` once to perform the transfers together, and reads the futures
just before execution. Which implementation a device uses is configuration: factories are registered by name
(``cpu``, ``gpu``) and picked by the ``--device`` string, never by if-chains in callers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np


class TransferFuture:
    """The device tensor a scheduled transfer produces; valid once the executor's ``run()`` returned."""

    __slots__ = ("_value",)

    def __init__(self, value=None):
        self._value = value

    def set(self, value) -> None:
        self._value = value

    def result(self):
        return self._value


class H2DTransferExecutor(ABC):
    """Moves the host inputs of one run to one device."""

    @abstractmethod
    def schedule(self, array: np.ndarray) -> TransferFuture:
        """Schedule ``array``'s transfer; the future completes when ``run()`` returns."""

    @abstractmethod
    def run(self) -> None:
        """Perform every scheduled transfer."""


class H2DTransferExecutorFactory(ABC):
    """Makes one H2DTransferExecutor per run for one device."""

    device: str
    # True where device tensors are the host arrays themselves, so callers may skip the transfer step.
    passthrough: bool = False

    @abstractmethod
    def create(self) -> H2DTransferExecutor: ...


_FACTORIES: dict[str, Callable[[int], H2DTransferExecutorFactory]] = {}


def register_factory(kind: str, make: Callable[[int], H2DTransferExecutorFactory]) -> None:
    """Register ``make(device_index)`` as the factory maker for devices named ``kind`` or ``kind:N``."""
    _FACTORIES[kind] = make


def make_factory(device: str) -> H2DTransferExecutorFactory:
    """The factory for a device string such as ``cpu`` or ``gpu:0``; ValueError names the known kinds."""
    kind, _, index = device.partition(":")
    make = _FACTORIES.get(kind)
    if make is None or (index and not index.isdigit()):
        raise ValueError(f"unknown device {device!r}: expected one of {sorted(_FACTORIES)}, optionally ':N'")
    return make(int(index or 0))
