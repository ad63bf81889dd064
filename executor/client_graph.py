"""LoadedClientGraph: a built client graph (the model's graph pruned to one set of feeds, fetches and targets, as a
session callable), and how a run of it goes: on its run worker's thread, or, for a compute-bound graph's runs that go
alone where that is faster, handed to TensorFlow's inter-op pool (cost_model.py's ThreadModeChooser). The
GraphExecutor (graph_executor.py) builds and caches them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from servex.executor.cost_model import ThreadModeChooser
from servex.loader.errors import InvalidArgument
from servex.loader.variables import PREPARE_POOL

log = logging.getLogger(__name__)

Key = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class FeedSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...] | None  # None: unknown rank


@dataclass
class LoadedClientGraph:
    """A built client graph: the session callable over the pruned graph and what it needs."""

    key: str  # printed: in1-in2^out1-out2^t1-t2
    names: Key  # sorted feeds, fetches, targets
    feeds: tuple[FeedSpec, ...]  # sorted by name
    fetch_names: tuple[str, ...]  # sorted, unique
    target_names: tuple[str, ...]  # sorted, unique
    variables: frozenset[str]  # variable ops the pruned graph reads
    build_seconds: float
    pinned: bool
    _callable: object
    variables_ready: bool = False  # every variable it reads is on the device
    # With runs on the worker thread: makes the same graph's callable that hands its ops to TensorFlow's inter-op
    # pool, and the chooser that learns which of the two runs it faster (ThreadModeChooser).
    _make_pooled: Callable[[], object] | None = None
    _chooser: ThreadModeChooser | None = None
    _pooled: object = None
    _making: object = None  # the Future making _pooled on the prepare pool, once asked for

    def run(self, sorted_feeds: Sequence[np.ndarray], alone: bool = True) -> list[np.ndarray]:
        """Run with feed values in ``feeds`` order; returns fetches in ``fetch_names`` order, each an ndarray.
        ``alone``: no other run of the graph goes and nothing of it waits; a run under load goes on its worker."""
        chooser = self._chooser
        if chooser is None or not alone:
            return self._run(self._callable, sorted_feeds)
        if chooser.pooled is not None:
            return self._run(self._pooled if chooser.pooled else self._callable, sorted_feeds)
        pooled = chooser.pick() and self._pooled_callable() is not None  # until it is made: on the worker
        started = time.perf_counter()
        results = self._run(self._pooled if pooled else self._callable, sorted_feeds)
        rows = sorted_feeds[0].shape[0] if sorted_feeds and sorted_feeds[0].ndim else 1
        chooser.record(pooled, rows, time.perf_counter() - started)
        return results

    def _pooled_callable(self):
        """The callable that hands the graph's ops to the inter-op pool, or None while it is made on the prepare
        pool, off the requests' path: making ResNet-50's took 0.7 s, DenseNet-121's 1.4 s (a compute-bound graph's
        first runs went on that long the first time the pool was tried)."""
        if self._pooled is None and self._making is None:
            self._making = PREPARE_POOL.submit(self._make_pooled_callable)
        return self._pooled

    def _make_pooled_callable(self) -> None:
        try:
            self._pooled = self._make_pooled()
        except Exception:  # its runs stay on the worker, where they went
            log.exception("client graph %s: making its inter-op pool callable failed; its runs stay on its worker",
                          self.key)  # fmt: skip
            self._chooser.pooled = False

    def _run(self, fn, sorted_feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        try:
            with tf.profiler.experimental.Trace(self.key):  # named in profiles (--enable_profiler); ~0.3 µs when off
                results = fn(*sorted_feeds)
        except UnicodeDecodeError as e:
            # TensorFlow's error message quoted bytes that are not UTF-8 (ParseExample quoting a client's
            # serialized example, RestoreV2 a file name), and turning it into a Python string failed before any
            # OpError was raised: its status code is lost, but the message is the client's input's doing.
            raise _undecodable_error(self.key, e) from e
        for i, value in enumerate(results):
            # The session answers a 0-d fetch as a scalar: bytes for DT_STRING, a NumPy scalar otherwise.
            if not isinstance(value, np.ndarray):
                results[i] = np.asarray(value, dtype=object if isinstance(value, bytes) else None)
        return results


def _undecodable_error(key: str, error: UnicodeDecodeError) -> InvalidArgument:
    """TensorFlow's error, as far as its message could be read: TensorFlow hands Python the message only up to
    the first byte that is not UTF-8, and raises UnicodeDecodeError instead of the OpError."""
    raw = bytes(error.object) if isinstance(error.object, bytes | bytearray) else b""
    text = raw.decode("utf-8", errors="replace")
    cut = error.end >= len(raw)
    return InvalidArgument(
        f"running {key!r} failed: TensorFlow's error, whose message holds bytes that are not UTF-8 (shown as "
        f"U+FFFD{'; it is cut there, as TensorFlow hands it over' if cut else ''}): {text}{'...' if cut else ''}"
    )
