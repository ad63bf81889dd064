"""RunHandler: the worker threads every run goes through, so that TensorFlow never runs on the event loop.

Callers on an asyncio loop ``await handler.submit(fn, *args)``; a worker thread runs ``fn`` and hands the result
(or exception) back to the caller's loop. Work is taken in arrival order. (Priorities, deadlines and batching
build on this queue.)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def _deliver(future: asyncio.Future, ok: bool, value) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(value)
    elif isinstance(value, StopIteration):  # asyncio refuses to carry StopIteration through a future
        future.set_exception(RuntimeError(f"run raised StopIteration: {value!r}"))
    else:
        future.set_exception(value)


class _Outbox:
    """Results on their way back to one event loop: one wake-up of the loop carries all that are ready.

    Under load the cross-thread hand-off, not TensorFlow, is what costs most per request; a worker that finds
    the outbox already scheduled for delivery just adds its result.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._results: list = []

    def put(self, future: asyncio.Future, ok: bool, value) -> None:
        with self._lock:
            self._results.append((future, ok, value))
            first = len(self._results) == 1
        if first:
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop closed during shutdown; nobody is waiting any more
                log.debug("a run finished after its event loop closed")

    def _flush(self) -> None:
        with self._lock:
            results, self._results = self._results, []
        for future, ok, value in results:
            _deliver(future, ok, value)


class RunHandler:
    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        self._threads = [
            threading.Thread(target=self._work, name=f"servex-run-{i}", daemon=True) for i in range(num_workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> asyncio.Future:
        """Queue ``fn(*args)``; the returned future (on the running loop) completes with its result."""
        if self._closed:
            raise RuntimeError("RunHandler is closed")
        loop = asyncio.get_running_loop()
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes.setdefault(loop, _Outbox(loop))
        future = loop.create_future()
        self._queue.put((outbox, future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            outbox, future, fn, args = item
            if future.cancelled():  # the caller went away while this waited
                continue
            try:
                result, ok = fn(*args), True
            except BaseException as e:  # handed to the caller, which decides what it means
                result, ok = e, False
            outbox.put(future, ok, result)

    def close(self) -> None:
        """Let queued work finish, then stop the workers; later submits raise RuntimeError."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
