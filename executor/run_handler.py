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


class RunHandler:
    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
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
            item = self._queue.get()
            if item is None:
                return
            loop, future, fn, args = item
            if future.cancelled():  # the caller went away while this waited
                continue
            try:
                result, ok = fn(*args), True
            except BaseException as e:  # handed to the caller, which decides what it means
                result, ok = e, False
            try:
                loop.call_soon_threadsafe(_deliver, future, ok, result)
            except RuntimeError:  # the loop closed during shutdown; nobody is waiting any more
                log.debug("run finished after its event loop closed")

    def close(self) -> None:
        """Let queued work finish, then stop the workers; later submits raise RuntimeError."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
