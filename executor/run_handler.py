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


def _deliver_all(results: list) -> None:
    for future, ok, value in results:
        _deliver(future, ok, value)


class RunHandler:
    def __init__(self, num_workers: int, drain: int = 8):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._drain = drain
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
        future = loop.create_future()
        self._queue.put((loop, future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            items = [self._queue.get()]
            # Take what else is already waiting (up to a few), and hand all results back in one wake-up of the
            # loop: under load the cross-thread hand-off, not TensorFlow, is what costs most per request.
            while len(items) < self._drain and items[-1] is not None:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = items[-1] is None
            done: dict[asyncio.AbstractEventLoop, list] = {}
            for item in items[:-1] if stop else items:
                loop, future, fn, args = item
                if future.cancelled():  # the caller went away while this waited
                    continue
                try:
                    result, ok = fn(*args), True
                except BaseException as e:  # handed to the caller, which decides what it means
                    result, ok = e, False
                done.setdefault(loop, []).append((future, ok, result))
            for loop, results in done.items():
                try:
                    loop.call_soon_threadsafe(_deliver_all, results)
                except RuntimeError:  # the loop closed during shutdown; nobody is waiting any more
                    log.debug("runs finished after their event loop closed")
            if stop:
                return

    def close(self) -> None:
        """Let queued work finish, then stop the workers; later submits raise RuntimeError."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
