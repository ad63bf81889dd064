"""The H2DTransferExecutor contract and the registry of factories that make them.

Per run, the caller asks the device's factory for a fresh H2DTransferExecutor, ``schedule``s every host input
on it (each call returns a future), calls ``run()`` once to perform the transfers together, and reads the futures
just before execution (``H2DTransferExecutorFactory.transfer`` does exactly that in one call, and an
implementation may do it faster). Which implementation a device uses is configuration: factories are registered
by kind (``cpu``, ``gpu``) and picked by the ``--device`` string (``cpu``, ``gpu:N``, ``auto``), never by
if-chains in callers. A device that cannot be used here raises DeviceError when its factory is made, so that the
process fails at start, not at the first request.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

# What --device=auto tries, in order; the last one must always work.
AUTO_ORDER = ("gpu:0", "cpu")


class DeviceError(ValueError):
    """A --device that is unknown, or that this machine cannot use (no CuPy, no CUDA device); says which."""


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
    """Moves the host inputs of one run to the device of the factory that made it."""

    device: str = ""

    @abstractmethod
    def schedule(self, array: np.ndarray, device: str | None = None) -> TransferFuture:
        """Schedule ``array``'s transfer to ``device`` (None: this executor's); the future completes when
        ``run()`` returns. A device other than this executor's is a DeviceError."""

    @abstractmethod
    def run(self) -> None:
        """Perform every scheduled transfer."""

    def _check_device(self, device: str | None) -> None:
        if device is not None and device != self.device:
            raise DeviceError(f"this transfer executor targets {self.device!r}, not {device!r}")


class H2DTransferExecutorFactory(ABC):
    """Makes one H2DTransferExecutor per run for one device."""

    device: str

    @abstractmethod
    def create(self) -> H2DTransferExecutor: ...

    def transfer(self, arrays: Sequence[np.ndarray]) -> list:
        """One run's transfers: schedule every array, run them together, return the device tensors in order."""
        executor = self.create()
        futures = [executor.schedule(a) for a in arrays]
        executor.run()
        return [f.result() for f in futures]

    def close(self) -> None:
        """Release what the factory holds (threads, staging buffers); the default holds nothing."""
        return None


_FACTORIES: dict[str, Callable[[int], H2DTransferExecutorFactory]] = {}


def register_factory(kind: str, make: Callable[[int], H2DTransferExecutorFactory]) -> None:
    """Register ``make(device_index)`` as the factory maker for devices named ``kind`` or ``kind:N``.

    ``make`` may raise DeviceError when the device cannot be used on this machine."""
    _FACTORIES[kind] = make


def make_factory(device: str) -> H2DTransferExecutorFactory:
    """The factory for a device string: ``cpu``, ``gpu:0``, or ``auto`` (the first of AUTO_ORDER that works here,
    logging why the ones before it did not). DeviceError (a ValueError) names the known kinds or what is missing."""
    if device == "auto":
        for candidate in AUTO_ORDER[:-1]:
            try:
                factory = make_factory(candidate)
            except DeviceError as e:
                log.warning("--device=auto: %s; falling back to %s", e, AUTO_ORDER[-1])
                continue
            log.info("--device=auto: using %s", factory.device)
            return factory
        return make_factory(AUTO_ORDER[-1])
    kind, _, index = device.partition(":")
    make = _FACTORIES.get(kind)
    if make is None or (index and not index.isdigit()) or device.endswith(":"):
        raise DeviceError(
            f"unknown device {device!r}: expected one of {sorted(_FACTORIES)}, optionally ':N' (e.g. 'gpu:0'), "
            "or 'auto'"
        )
    return make(int(index or 0))
