"""Staging one run's host inputs through a bounded pool of reusable (page-locked) buffers, without CUDA.

A run's inputs are laid out back to back in one device buffer (each at a ALIGN-byte boundary), so many small
inputs travel in one staging buffer and one copy. A large run is staged in ranges that start small and double up
to a buffer's size, so that the first device copy starts after a short fill and the later ones are big enough to
run at full speed. Each range's staging buffer is filled on the host and handed to ``copy_async``, which enqueues
the device copy and returns the event that marks its end; the buffer goes back to the pool with that event, and
is reused only once its event is done. A large run's ranges are filled by several threads at once while the
earlier ones are copied: one thread's memory copy is far slower than the PCIe link (6 against 53 GB/s on an H100
machine). transfer/cupy_gpu.py supplies the pinned allocator and the CUDA copy; the tests drive this module with
host buffers.
"""

from __future__ import annotations

import itertools
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np

# Offsets of inputs in the run's device buffer: what cudaMalloc guarantees, enough for every dtype and DLPack.
ALIGN = 256
# Runs at least this big are filled by several threads (NumPy releases the GIL while it copies).
PARALLEL_MIN_BYTES = 4 << 20
# A run's first staged range: small, so that its copy starts soon; the ranges after it double up to a buffer.
FIRST_CHUNK_BYTES = 256 << 10


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
            try:
                event.synchronize()  # the copy that last read this buffer has finished
            except BaseException:
                self.release(buffer)  # not lost to the pool: the next taker waits on nothing it could
                raise
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


def chunk_ranges(total: int, chunk: int, first: int = FIRST_CHUNK_BYTES) -> list[tuple[int, int]]:
    """The [c0, c1) byte ranges a run's ``total`` bytes are staged in: ``first`` bytes, then each range twice the
    last, up to ``chunk`` (the staging buffer size)."""
    ranges, c0, size = [], 0, min(first, chunk)
    while c0 < total:
        c1 = min(c0 + size, total)
        ranges.append((c0, c1))
        c0, size = c1, min(size * 2, chunk)
    return ranges


def stage(
    flats: Sequence[np.ndarray],
    offsets: Sequence[int],
    total: int,
    pool: StagingPool,
    copy_async: Callable[[StagingBuffer, int, int], object],
    threads: Executor | None = None,
    helpers: int = 0,
) -> int:
    """Copy the inputs' bytes (``flats``: C-contiguous uint8 views, at ``offsets`` of a ``total``-byte device
    buffer) through the pool, in the ranges of ``chunk_ranges``: a worker takes the next range, fills a staging
    buffer with it, and ``copy_async(buffer, device_offset, nbytes)`` enqueues its device copy and returns the event
    that marks the copy's end. The caller is a worker; a run of PARALLEL_MIN_BYTES or more also has up to
    ``helpers`` workers on ``threads``, so ranges are filled in parallel while earlier ones are copied (a worker
    holds one buffer at a time: runs sharing the pool never deadlock). Returns the number of ranges."""
    ends = [o + f.size for o, f in zip(offsets, flats, strict=True)]
    parallel = threads is not None and helpers > 0 and total >= PARALLEL_MIN_BYTES
    # Alone, a worker gains nothing from small first ranges: buffer-sized ones make fewer copies.
    ranges = chunk_ranges(total, pool.buffer_bytes, FIRST_CHUNK_BYTES if parallel else pool.buffer_bytes)
    taken = itertools.count()  # next() on it is atomic: each range goes to one worker
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            i = next(taken)
            if i >= len(ranges):
                return
            c0, c1 = ranges[i]
            buffer = None
            try:
                buffer = pool.acquire()
                _fill(buffer, _pieces(flats, offsets, ends, c0, c1))
                event = copy_async(buffer, c0, c1 - c0)
            except BaseException as e:
                if buffer is not None:
                    pool.release(buffer)
                failed.append(e)  # stops the other workers; the range is not copied
                raise
            pool.release(buffer, event)

    jobs = [threads.submit(work) for _ in range(min(helpers, len(ranges) - 1))] if parallel else []
    try:
        work()
    finally:
        for job in jobs:  # not started: never will; started: wait for its range
            if not job.cancel():
                job.exception()
    if failed:  # a helper's failure too: some range was never copied
        raise failed[0]
    return len(ranges)
