"""Staging one run's host inputs through a bounded pool of reusable (page-locked) buffers, without CUDA.

A run's inputs are laid out back to back in one device buffer (each at a ALIGN-byte boundary), so many small
inputs travel in one staging buffer and one copy, and a large one in buffer-sized chunks. ``stage`` fills each
chunk's staging buffer on the host (on copy threads when the chunk is big) and hands it to ``copy_async``, which
enqueues the device copy and returns the event that marks its end; the buffer goes back to the pool with that
event, and is reused only once its event is done. Several chunks are in flight at once, so the host fills one
while the previous ones are copied. transfer/cupy_gpu.py supplies the pinned allocator and the CUDA copy; the
tests drive this module with host buffers.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

import numpy as np

# Offsets of inputs in the run's device buffer: what cudaMalloc guarantees, enough for every dtype and DLPack.
ALIGN = 256
# Chunks at least this big are filled on a copy thread (NumPy releases the GIL), smaller ones inline.
PARALLEL_MIN_BYTES = 1 << 20


def layout(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets of inputs of these byte sizes laid out back to back at ``align`` boundaries, and the total."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets, total


class StagingBuffer:
    """One staging buffer: ``host`` is a uint8 NumPy view of it, ``ptr`` its address."""

    __slots__ = ("host", "ptr", "owner")

    def __init__(self, host: np.ndarray, owner=None):
        self.host = host
        self.ptr = host.__array_interface__["data"][0]
        self.owner = owner  # what keeps the memory alive (CuPy's PinnedMemoryPointer)


class StagingPool:
    """At most ``max_buffers`` buffers of ``buffer_bytes``, made by ``alloc`` on first need and reused forever.

    A released buffer carries the event of the copy that reads it; it is handed out again only after that event
    completed (``event.synchronize()``), oldest release first.
    """

    def __init__(self, buffer_bytes: int, max_buffers: int, alloc: Callable[[int], StagingBuffer]):
        if buffer_bytes < ALIGN or max_buffers < 1:
            raise ValueError(f"a staging pool needs buffers of at least {ALIGN} bytes and at least one buffer")
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._alloc = alloc
        self._free: deque[tuple[StagingBuffer | None, object]] = deque()
        self.allocated = 0
        self._cond = threading.Condition()

    def try_acquire(self) -> StagingBuffer | None:
        """A buffer, or None when all exist and are taken."""
        with self._cond:
            if self._free:
                buffer, event = self._free.popleft()
            elif self.allocated < self.max_buffers:
                self.allocated += 1
                buffer, event = None, None
            else:
                return None
        return self._ready(buffer, event)

    def acquire(self) -> StagingBuffer:
        """A buffer, waiting for one to be released when all are taken."""
        with self._cond:
            while not self._free and self.allocated >= self.max_buffers:
                self._cond.wait()
            if self._free:
                buffer, event = self._free.popleft()
            else:
                self.allocated += 1
                buffer, event = None, None
        return self._ready(buffer, event)

    def _ready(self, buffer: StagingBuffer | None, event) -> StagingBuffer:
        if buffer is None:
            try:
                return self._alloc(self.buffer_bytes)
            except BaseException:
                with self._cond:
                    self.allocated -= 1
                    self._cond.notify()
                raise
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has finished
        return buffer

    def release(self, buffer: StagingBuffer, event=None) -> None:
        with self._cond:
            self._free.append((buffer, event))
            self._cond.notify()


def _pieces(flats, offsets, ends, c0: int, c1: int) -> list[tuple[np.ndarray, int, int, int]]:
    """(input bytes, from, to, offset in the chunk) of every input overlapping the chunk [c0, c1)."""
    pieces = []
    i = max(bisect_right(offsets, c0) - 1, 0)
    while i < len(flats) and offsets[i] < c1:
        lo, hi = max(c0, offsets[i]), min(c1, ends[i])
        if lo < hi:
            pieces.append((flats[i], lo - offsets[i], hi - offsets[i], lo - c0))
        i += 1
    return pieces


def _fill(buffer: StagingBuffer, pieces) -> None:
    host = buffer.host
    for flat, lo, hi, at in pieces:
        host[at : at + hi - lo] = flat[lo:hi]


def stage(
    flats: Sequence[np.ndarray],
    offsets: Sequence[int],
    total: int,
    pool: StagingPool,
    copy_async: Callable[[StagingBuffer, int, int], object],
    threads: Executor | None = None,
    depth: int = 2,
) -> int:
    """Copy the inputs' bytes (``flats``: C-contiguous uint8 views, at ``offsets`` of a ``total``-byte device
    buffer) through the pool: ``copy_async(buffer, device_offset, nbytes)`` enqueues one chunk's device copy and
    returns its event. At most ``depth`` chunks are being filled at once. Returns the number of chunks."""
    ends = [o + f.size for o, f in zip(offsets, flats, strict=True)]
    chunk = pool.buffer_bytes
    queue: deque[tuple[StagingBuffer, Future | None, int, int]] = deque()

    def flush() -> None:
        buffer, job, c0, c1 = queue.popleft()
        try:
            if job is not None:
                job.result()
            event = copy_async(buffer, c0, c1 - c0)
        except BaseException:
            pool.release(buffer)
            raise
        pool.release(buffer, event)

    count = 0
    try:
        for c0 in range(0, total, chunk):
            c1 = min(c0 + chunk, total)
            buffer = pool.try_acquire()
            while buffer is None:  # all taken: send our own chunks first, so runs never wait on each other's
                if queue:
                    flush()
                    buffer = pool.try_acquire()
                else:
                    buffer = pool.acquire()
            pieces = _pieces(flats, offsets, ends, c0, c1)
            if threads is not None and c1 - c0 >= PARALLEL_MIN_BYTES:
                queue.append((buffer, threads.submit(_fill, buffer, pieces), c0, c1))
            else:
                try:
                    _fill(buffer, pieces)
                except BaseException:
                    pool.release(buffer)
                    raise
                queue.append((buffer, None, c0, c1))
            count += 1
            if len(queue) >= depth:
                flush()
        while queue:
            flush()
    finally:
        while queue:  # after a failure: wait for fills in progress, then give the buffers back unused
            buffer, job, _, _ = queue.popleft()
            if job is not None:
                job.exception()
            pool.release(buffer)
    return count
