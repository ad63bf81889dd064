"""LoadedClientGraph: a built client graph (the model's graph pruned to one set of feeds, fetches and targets, as a
session callable), and how a run of it goes: on its run worker's thread; or, for a compute-bound graph where its lone
runs were found faster so (thread_modes.py), handed to TensorFlow's inter-op pool, or in the version's second session,
whose intra-op pool has one thread (loader/one_thread.py), or as XLA's program for its feeds' shapes (loader/xla.py,
xla_programs.py; under load too, its batches padded to a few sizes by the RunHandler). The GraphExecutor
(graph_executor.py) builds and caches them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from servex.executor.thread_modes import ONE_THREAD, POOL, WORKER, XLA, ThreadModeChooser
from servex.executor.xla_programs import XlaPrograms
from servex.loader.errors import InvalidArgument, ResourceExhausted
from servex.loader.variables import PREPARE_POOL, RunGate

log = logging.getLogger(__name__)

# Once XLA is chosen, other shapes are compiled for once this many runs had them: at 8 callers the encoder's lone
# runs came in many batch sizes, and compiling each (0.6 s of a core) beside the requests cost more than it gave.
# Batches are padded to a few sizes (batching.py's program_rows), which each get their program.
SEEN = 3

Key = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]

_RAN = threading.local()


def ran_on_one_thread() -> bool:
    """Whether this thread's last run went in a one-thread session, its graph's mode chosen (not a trial's run): for
    the cost model's choice (cost_model.py)."""
    return getattr(_RAN, "one_thread", False)


def ran_compiled_graph() -> bool:
    """Whether this thread's last run was of a graph whose runs take XLA's programs (compiled per batch size: its
    batches are padded to a few sizes, batching.py's ``program_rows``)."""
    return getattr(_RAN, "compiled", False)


# The threads that run one-thread sessions' runs, and nothing else. TensorFlow keeps its oneDNN kernels (a
# convolution's, a matrix product's) in a cache per thread, keyed by the op's shapes and not by the threads they were
# planned for: a thread that ran a graph on two threads then ran MobileNetV2's one-thread session in 20.6 ms a
# request, a fresh thread in 12.5 (the two-thread session: 16.0-17.5).
ONE_THREAD_RUNS = ThreadPoolExecutor(max_workers=max(2, len(os.sched_getaffinity(0))), thread_name_prefix="servex-one")


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
    # With runs on the worker thread: the chooser that learns which mode its lone runs go fastest in
    # (thread_modes.py), and for each other mode what makes its callable (on the prepare pool, once asked for).
    _chooser: ThreadModeChooser | None = None
    _makers: dict[str, Callable[[], object]] = field(default_factory=dict)
    _made: dict[str, object] = field(default_factory=dict)
    _making: dict[str, object] = field(default_factory=dict)
    # Give the one-thread and XLA sessions back (each called once, when another mode was chosen); runs in them go
    # through the gate.
    _releases: dict[str, Callable[[], None]] = field(default_factory=dict)
    _gate: RunGate = field(default_factory=RunGate)
    # XLA's program per set of feed shapes: True once compiled and its answer checked, False where that failed,
    # None while it compiles (xla_programs.py).
    _xla: XlaPrograms | None = None

    def run(self, sorted_feeds: Sequence[np.ndarray], alone: bool = True) -> list[np.ndarray]:
        """Run with feed values in ``feeds`` order; returns fetches in ``fetch_names`` order, each an ndarray.
        ``alone``: no other run of the graph goes and nothing of it waits; a run under load goes on its worker, or
        in the one-thread session or as XLA's program, where its lone runs were found faster there (a graph whose
        lone runs keep the pool: in the one-thread session, where that beat its worker)."""
        chooser = self._chooser
        _RAN.one_thread = _RAN.compiled = False
        if chooser is None:
            return self._run(self._callable, sorted_feeds)
        mode = chooser.mode
        _RAN.compiled = mode == XLA
        if mode is None and alone:
            return self._trial(chooser, sorted_feeds)
        if mode == XLA:  # alone or under load: its program where one is compiled for these shapes
            results = self._xla.run(sorted_feeds)
            if results is not None:
                _RAN.one_thread = True  # (the XLA session's programs run on one thread: loader/xla.py)
                return results
            if chooser.under_load == ONE_THREAD:
                results, _RAN.one_thread = self._run_one_thread(sorted_feeds)
            else:
                results = self._run(self._callable, sorted_feeds)
            self._xla.compile(sorted_feeds, results, after=SEEN)  # shapes seen SEEN times: compiled beside
            return results
        if mode == ONE_THREAD:
            results, _RAN.one_thread = self._run_one_thread(sorted_feeds)
            return results
        if mode == POOL and alone:
            return self._run(self._made[POOL], sorted_feeds)
        if mode == POOL and chooser.under_load == ONE_THREAD:
            results, _RAN.one_thread = self._run_one_thread(sorted_feeds)
            return results
        return self._run(self._callable, sorted_feeds)

    def _trial(self, chooser: ThreadModeChooser, sorted_feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        mode = chooser.pick()
        # A run beside a callable being made or a program compiled (on the prepare pool) is not timed: its time, and
        # the cores it keeps busy, would not be its own (one making the one-thread session read the encoder's XLA
        # runs 9.5 ms against 7.3 with nothing beside them).
        quiet = self._quiet()
        busy = cpu = None
        xla = self._xla  # None once another mode is chosen (by a compile that failed, beside this run)
        started = time.perf_counter()
        if mode == ONE_THREAD and self._mode_callable(mode) is not None:
            results, in_it = self._run_one_thread(sorted_feeds)
            quiet = quiet and in_it
        elif mode == POOL and (pooled := self._mode_callable(mode)) is not None:
            results = self._run(pooled, sorted_feeds)
        elif mode == XLA and self._mode_callable(mode) is not None and xla is not None and xla.ready(sorted_feeds):
            results = xla.run(sorted_feeds)
            if results is None:  # given back meanwhile
                quiet, results = False, self._run(self._callable, sorted_feeds)
        else:  # the worker, or until the mode's callable is made (XLA's: and its program compiled)
            cpu = time.process_time() if chooser.gated and quiet else None
            wanted, mode, results = mode, WORKER, self._run(self._callable, sorted_feeds)
            if wanted == XLA and self._made.get(XLA) is not None and xla is not None:
                xla.compile(sorted_feeds, results)
        ran = time.perf_counter() - started if quiet and self._quiet() else None
        if cpu is not None and ran:
            busy = (time.process_time() - cpu) / ran
        rows = sorted_feeds[0].shape[0] if sorted_feeds and sorted_feeds[0].ndim else 1
        if ran is not None:
            chooser.record(mode, rows, ran, busy)
            if mode == WORKER and POOL in self._makers and POOL not in self._making and chooser.mode is None:
                self._pool_or_not(chooser, busy)
        if chooser.mode is not None:
            self._settle(chooser.mode)
        return results

    def _pool_or_not(self, chooser: ThreadModeChooser, busy: float | None) -> None:
        """After the graph's first timed lone run on its worker: its pooled callable is made now, on the worker
        before this run's answer, where the pool may be tried; else never. Making a callable holds the session's
        runs while TensorFlow's optimizers go over the graph (beside the requests it held one MobileNetV2 request
        1.0-1.4 s), so it is made while this graph's first request waits anyway, not beside its runs; and only where
        it may serve: a small graph (told at its first run) or one whose run kept the cores busy over the pool's
        line (ResNet-50 on 2 cores: 1.66 at its first run) never makes it (1.2 s of ResNet-50's first request)."""
        maker = self._makers.pop(POOL)  # (asked once)
        pooled = None
        shown = "" if busy is None else f"{busy:.2f}"
        if not chooser.may_try(POOL, busy):
            log.debug("client graph %s: its first lone run kept %s cores busy: the inter-op pool not tried", self.key,
                      shown)  # fmt: skip
        else:
            started = time.perf_counter()
            try:
                pooled = maker()
                log.debug("client graph %s: its first lone run kept %s cores busy: the inter-op pool's callable made "
                          "in %.3fs", self.key, shown or "?", time.perf_counter() - started)  # fmt: skip
            except ResourceExhausted as e:  # its runs stay on the worker, and no call is refused
                log.info("client graph %s: the inter-op pool not tried: %s", self.key, e)
            except Exception:  # (TensorFlow could not make it) its runs stay on the worker
                log.exception("client graph %s: making its inter-op pool's callable failed; its runs stay on its "
                              "worker", self.key)  # fmt: skip
        if pooled is None:
            chooser.drop(POOL)
        else:
            self._made[POOL] = pooled

    def _quiet(self) -> bool:
        """Nothing is made or compiled beside the graph's runs."""
        xla = self._xla
        return all(f.done() for f in self._making.values()) and not (xla is not None and xla.compiling())

    def _run_one_thread(self, sorted_feeds: Sequence[np.ndarray]) -> tuple[list[np.ndarray], bool]:
        """A run in the one-thread session, on a thread of ONE_THREAD_RUNS, while it is not given back (else on the
        worker); whether it was."""
        self._gate.enter()
        try:
            fn = self._made.get(ONE_THREAD)
            if fn is None:
                return self._run(self._callable, sorted_feeds), False
            return ONE_THREAD_RUNS.submit(self._run, fn, sorted_feeds).result(), True
        finally:
            self._gate.leave()

    def _mode_callable(self, mode: str):
        """The mode's callable, or None while it is made on the prepare pool, off the requests' path: the one-thread
        one restores the variables into the version's second session first, XLA's compiles. (The pooled one, in the
        version's own session, is made after the graph's first lone run: ``_pool_or_not``.)"""
        fn = self._made.get(mode)
        if fn is None and mode not in self._making:
            self._making[mode] = PREPARE_POOL.submit(self._make, mode)
        return fn

    def _make(self, mode: str) -> None:
        try:
            fn = self._makers[mode]()
        except ResourceExhausted as e:  # its runs stay on the worker, where they went, and no call is refused
            log.info("client graph %s: the %s session not tried: %s", self.key, mode, e)
            fn = None
        except Exception:  # its runs stay on the worker, where they went
            log.exception("client graph %s: making its %s callable failed; its runs stay on its worker", self.key,
                          mode)  # fmt: skip
            fn = None
        if fn is None:
            self._chooser.drop(mode)
            if self._chooser.mode is not None:
                self._settle(self._chooser.mode)
        else:
            self._made[mode] = fn

    def _settle(self, chosen: str) -> None:
        """The mode is chosen: let go of the one-thread and XLA sessions' callables and shares, but the chosen one's
        (once no run is in them)."""
        if chosen != XLA:
            self._xla = None  # nothing more to compile or count (a small graph's runs: from its first)
        if chosen != POOL:
            pooled = [self._made.pop(POOL, None)]  # (made after its first lone run: _pool_or_not)
            if pooled[0] is not None:  # its executors go, off the requests' path
                PREPARE_POOL.submit(_let_go, pooled)
        kept = {chosen, self._chooser.under_load}
        for mode in [m for m in self._releases if m not in kept]:
            release = self._releases.pop(mode, None)
            if release is not None and mode in self._making:
                self._making[mode].add_done_callback(lambda _, m=mode, r=release: self._give_back(m, r))

    def _give_back(self, mode: str, release: Callable[[], None]) -> None:
        """The mode's callable is taken out once no run is in it (the gate held: runs take it under the gate); it
        goes, and its session's share is released, on the prepare pool (``_let_go``), outside the gate."""
        dropped: list = []
        self._gate.exclusive(lambda: dropped.append(self._made.pop(mode, None)))
        if dropped[0] is not None:
            PREPARE_POOL.submit(_let_go, dropped, release)

    def _xla_failed(self) -> None:
        """A compile failed or answered otherwise: XLA is no longer tried (a graph that chose it keeps its checked
        programs)."""
        self._chooser.drop(XLA)
        if self._chooser.mode is not None:
            self._settle(self._chooser.mode)

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
        xla = self._xla
        if xla is not None and fn is not self._made.get(XLA):
            xla.served(sorted_feeds)  # the session's kernels answered: its integers are in range
        return results


def _let_go(held: list, release: Callable[[], None] | None = None) -> None:
    """On the prepare pool, off the requests' path: the callables in ``held`` go (TensorFlow frees their executors
    then), then ``release`` gives back their session's share (the last share closes it). Done on the worker whose run
    settled a trial, this held that request: DenseNet-121's one-thread callable and session took 60-70 ms to go,
    the pool's callable 8 ms (that call 137-157 ms, against 60-80 for the others)."""
    held.clear()
    if release is not None:
        release()


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
