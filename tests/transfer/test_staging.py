"""Staging a run's inputs through the bounded buffer pool (transfer/staging.py), driven with host buffers: the
GPU path's layout, packing, growing ranges, parallel fills, buffer reuse and bound, without CUDA."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from servex.transfer.staging import ALIGN, FIRST_CHUNK_BYTES, StagingBuffer, StagingPool, chunk_ranges, layout, stage


class HostEvent:
    """Stands in for a CUDA event: done at once (host copies are synchronous); counts waits."""

    waits = 0

    def synchronize(self) -> None:
        HostEvent.waits += 1


class HostDevice:
    """A 'device' buffer in host memory; ``copy_async`` copies a staging buffer into it as CUDA would."""

    def __init__(self, total: int, copy_seconds: float = 0.0):
        self.copy_seconds = copy_seconds  # how long enqueueing a copy takes: lets helper threads join in
        self.memory = np.full(total, 0xEE, np.uint8)
        self.copies: list[tuple[int, int]] = []
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def copy_async(self, buffer: StagingBuffer, at: int, nbytes: int) -> HostEvent:
        with self.lock:
            self.memory[at : at + nbytes] = buffer.host[:nbytes]
            self.copies.append((at, nbytes))
            self.threads.add(threading.get_ident())
        time.sleep(self.copy_seconds)
        return HostEvent()


def host_alloc(nbytes: int) -> StagingBuffer:
    return StagingBuffer(np.empty(nbytes, np.uint8))


def run(arrays, pool, threads=None, helpers=0, copy_seconds=0.0):
    flats = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    offsets, total = layout([f.size for f in flats])
    device = HostDevice(total, copy_seconds)
    chunks = stage(flats, offsets, total, pool, device.copy_async, threads, helpers)
    views = [
        device.memory[o : o + a.nbytes].view(a.dtype).reshape(a.shape) for a, o in zip(arrays, offsets, strict=True)
    ]
    return views, device, chunks


def test_layout_aligns_every_input():
    offsets, total = layout([1, 0, 256, 257, 3])
    assert offsets == [0, 256, 256, 512, 1024]
    assert total == 1280
    assert all(o % ALIGN == 0 for o in offsets)
    assert layout([]) == ([], 0)


def test_many_small_inputs_travel_in_one_buffer_and_one_copy():
    pool = StagingPool(1 << 16, 4, host_alloc)
    arrays = [np.arange(i + 1, dtype=np.float32) * i for i in range(50)] + [np.array(True), np.arange(3, dtype=np.int8)]
    views, device, chunks = run(arrays, pool)
    assert chunks == 1 and len(device.copies) == 1
    assert pool.allocated == 1
    for view, array in zip(views, arrays, strict=True):
        np.testing.assert_array_equal(view, array)


def test_ranges_start_small_and_double_up_to_a_buffer():
    mib = 1 << 20
    assert chunk_ranges(100, 4 * mib) == [(0, 100)]
    assert chunk_ranges(0, 4 * mib) == []
    sizes = [c1 - c0 for c0, c1 in chunk_ranges(16 * mib, 4 * mib)]
    assert sizes[:5] == [
        FIRST_CHUNK_BYTES,
        2 * FIRST_CHUNK_BYTES,
        4 * FIRST_CHUNK_BYTES,
        8 * FIRST_CHUNK_BYTES,
        4 * mib,
    ]
    assert sum(sizes) == 16 * mib and max(sizes) == 4 * mib
    assert chunk_ranges(3 * mib, 64 << 10) == [(o, o + (64 << 10)) for o in range(0, 3 * mib, 64 << 10)]


@pytest.mark.parametrize("threads", [0, 3])
def test_a_large_input_goes_in_ranges_through_a_bounded_pool(threads):
    pool = StagingPool(1 << 20, 3, host_alloc)
    big = np.random.default_rng(0).random(3_000_000)  # 24 MB
    head, tail = np.arange(10, dtype=np.int64), np.arange(7, dtype=np.complex64)
    with ThreadPoolExecutor(max(threads, 1)) as pool_threads:
        views, device, chunks = run([head, big, tail], pool, pool_threads, helpers=threads, copy_seconds=0.002)
    total = big.nbytes + 2 * ALIGN
    first = FIRST_CHUNK_BYTES if threads else 1 << 20  # alone, the caller copies buffer-sized ranges
    assert chunks == len(device.copies) == len(chunk_ranges(total, 1 << 20, first))
    assert pool.allocated <= 3  # never more than the bound, however many ranges
    assert len(device.threads) > 1 if threads else device.threads == {threading.get_ident()}  # parallel fills
    for view, array in zip(views, [head, big, tail], strict=True):
        np.testing.assert_array_equal(view, array)
    covered = sorted(device.copies)
    assert covered[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:], strict=False))
    assert covered[-1][0] + covered[-1][1] == total


def test_a_small_run_is_staged_by_its_caller_alone():
    pool = StagingPool(1 << 20, 3, host_alloc)
    with ThreadPoolExecutor(3) as pool_threads:
        _, device, _ = run([np.ones(1000, np.float32)] * 20, pool, pool_threads, helpers=3)
    assert device.threads == {threading.get_ident()}


def test_buffers_are_reused_across_runs_after_their_copy_ended():
    pool = StagingPool(4096, 2, host_alloc)
    waits = HostEvent.waits
    for i in range(20):
        views, _, _ = run([np.full(100, i, np.int32)], pool)
        np.testing.assert_array_equal(views[0], np.full(100, i, np.int32))
    assert pool.allocated == 1
    assert HostEvent.waits - waits == 19  # each reuse waited on the event of the copy that read it


def test_non_contiguous_inputs_are_staged_by_value():
    pool = StagingPool(1024, 2, host_alloc)
    strided = np.arange(600, dtype=np.float32).reshape(20, 30)[::2, ::3]
    views, _, _ = run([strided], pool)
    np.testing.assert_array_equal(views[0], strided)


def test_concurrent_runs_share_a_small_pool_without_deadlock():
    pool = StagingPool(1024, 2, host_alloc)
    errors = []

    def one(seed: int) -> None:
        try:
            for k in range(20):
                arrays = [np.full(700 + k, seed, np.int16), np.full(900, -seed, np.int64)]
                views, _, _ = run(arrays, pool)
                for view, array in zip(views, arrays, strict=True):
                    np.testing.assert_array_equal(view, array)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    workers = [threading.Thread(target=one, args=(s,)) for s in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers), "staging deadlocked"
    assert not errors
    assert pool.allocated <= 2


def test_a_failed_copy_gives_its_buffers_back():
    pool = StagingPool(1024, 2, host_alloc)

    def fail(buffer, at, nbytes):
        raise RuntimeError("copy failed")

    flats = [np.zeros(6 << 20, np.uint8)]
    offsets, total = layout([6 << 20])
    with ThreadPoolExecutor(2) as threads, pytest.raises(RuntimeError, match="copy failed"):
        stage(flats, offsets, total, pool, fail, threads, helpers=2)
    assert pool.try_acquire() is not None and pool.try_acquire() is not None  # both came back
    assert pool.try_acquire() is None


def test_a_helpers_failure_fails_the_run():
    caller = threading.get_ident()

    def fails_on_helpers(nbytes):
        if threading.get_ident() != caller:
            raise MemoryError("no pinned memory on a copy thread")
        return host_alloc(nbytes)

    pool = StagingPool(1 << 20, 8, fails_on_helpers)
    device = HostDevice(8 << 20, copy_seconds=0.002)  # slow copies: the helpers take ranges
    with ThreadPoolExecutor(3) as threads, pytest.raises(MemoryError, match="copy thread"):
        stage([np.ones(8 << 20, np.uint8)], [0], 8 << 20, pool, device.copy_async, threads, helpers=3)
    assert pool.allocated == len(pool._free)  # every buffer made came back


def test_a_buffer_whose_wait_fails_goes_back_to_the_pool():
    class BrokenEvent:
        def synchronize(self):
            raise RuntimeError("cudaErrorLaunchFailure")

    pool = StagingPool(1024, 1, host_alloc)
    pool.release(pool.acquire(), BrokenEvent())
    with pytest.raises(RuntimeError, match="LaunchFailure"):
        pool.acquire()
    assert pool.try_acquire() is not None  # the one buffer is not lost


def test_a_failed_allocation_does_not_use_up_the_bound():
    calls = []

    def flaky(nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            raise MemoryError("no pinned memory")
        return host_alloc(nbytes)

    pool = StagingPool(1024, 1, flaky)
    with pytest.raises(MemoryError):
        pool.acquire()
    assert pool.allocated == 0
    assert pool.acquire() is not None


@pytest.mark.parametrize("args", [(100, 4), (4096, 0)])
def test_a_pool_needs_room(args):
    with pytest.raises(ValueError, match="staging pool"):
        StagingPool(*args, host_alloc)
