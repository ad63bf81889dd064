"""RunHandler: work runs on worker threads and its results and errors come back to the asyncio caller."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from servex.executor import GraphExecutor, RunHandler
from servex.loader import InvalidArgument, load_saved_model
from tests.conftest import HALF_PLUS_TWO_TF1

TIMEOUT = 10


@pytest.fixture
def handler():
    h = RunHandler(2)
    yield h
    h.close()


def run_async(coro_fn, *, exceptions: list | None = None):
    """asyncio.run with a loop exception handler that records what the loop would otherwise only log."""

    async def main():
        if exceptions is not None:
            asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: exceptions.append(ctx))
        return await coro_fn()

    return asyncio.run(main())


def test_results_come_back(handler):
    async def main():
        one = await handler.submit(lambda: 42)
        two = await asyncio.wait_for(handler.submit(pow, 2, 10), TIMEOUT)
        many = await asyncio.gather(*(handler.submit(lambda i=i: i * i) for i in range(20)))
        return one, two, many

    assert run_async(main) == (42, 1024, [i * i for i in range(20)])


def test_exceptions_come_back(handler):
    error = ValueError("bad input")

    def fail():
        raise error

    async def main():
        with pytest.raises(ValueError) as info:
            await asyncio.wait_for(handler.submit(fail), TIMEOUT)
        assert info.value is error
        # The worker survives and serves the next call.
        return await asyncio.wait_for(handler.submit(lambda: "still here"), TIMEOUT)

    assert run_async(main) == "still here"


def test_work_runs_off_the_event_loop_thread(handler):
    async def main():
        loop_thread = threading.get_ident()
        worker = await asyncio.wait_for(handler.submit(threading.get_ident), TIMEOUT)
        name = await asyncio.wait_for(handler.submit(lambda: threading.current_thread().name), TIMEOUT)
        return loop_thread, worker, name

    loop_thread, worker, name = run_async(main)
    assert worker != loop_thread
    assert worker != threading.get_ident()
    assert name.startswith("servex-run-")


def test_workers_run_in_parallel():
    n = 4
    h = RunHandler(n)
    barrier = threading.Barrier(n)
    try:

        async def main():
            # Each call waits until all n are running at once; with fewer workers the barrier breaks.
            return await asyncio.wait_for(
                asyncio.gather(*(h.submit(barrier.wait, TIMEOUT) for _ in range(n))), TIMEOUT * 2
            )

        assert sorted(run_async(main)) == list(range(n))
    finally:
        h.close()


def test_close_finishes_queued_work():
    h = RunHandler(1)
    release = threading.Event()
    done: list[int] = []

    def step(i):
        if i == 0:
            assert release.wait(TIMEOUT)
        done.append(i)
        return i

    async def main():
        futures = [h.submit(step, i) for i in range(6)]
        closing = asyncio.ensure_future(asyncio.to_thread(h.close))
        await asyncio.sleep(0.05)
        assert not closing.done()  # close() waits for the queued work
        release.set()
        await asyncio.wait_for(closing, TIMEOUT)
        assert done == list(range(6))  # everything queued before close() ran, in arrival order
        return await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT)

    assert run_async(main) == list(range(6))


def test_cancelled_waiting_work_is_skipped_without_error():
    h = RunHandler(1)
    release = threading.Event()
    ran: list[str] = []
    exceptions: list = []

    async def main():
        blocker = h.submit(lambda: release.wait(TIMEOUT))
        victim = h.submit(ran.append, "victim")
        victim.cancel()
        release.set()
        assert await asyncio.wait_for(blocker, TIMEOUT) is True
        after = await asyncio.wait_for(h.submit(ran.append, "after"), TIMEOUT)
        await asyncio.sleep(0.01)
        return victim, after

    try:
        victim, after = run_async(main, exceptions=exceptions)
    finally:
        h.close()
    assert victim.cancelled()
    assert after is None
    assert ran == ["after"]
    assert exceptions == []


def test_cancelled_running_work_has_its_result_dropped_without_error():
    h = RunHandler(1)
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []
    exceptions: list = []

    def slow():
        started.set()
        assert release.wait(TIMEOUT)
        finished.append(True)
        return "late"

    def slow_failure():
        started.set()
        assert release.wait(TIMEOUT)
        raise RuntimeError("late failure")

    async def main():
        for fn in (slow, slow_failure):
            started.clear()
            release.clear()
            future = h.submit(fn)
            assert await asyncio.to_thread(started.wait, TIMEOUT)
            future.cancel()
            release.set()
            # The next call completing means the cancelled one's delivery already ran on this loop.
            assert await asyncio.wait_for(h.submit(lambda: "next"), TIMEOUT) == "next"
            await asyncio.sleep(0.01)
            assert future.cancelled()

    try:
        run_async(main, exceptions=exceptions)
    finally:
        h.close()
    assert finished == [True]
    assert exceptions == []


def test_stop_iteration_reaches_the_caller(handler):
    # A function that raises StopIteration (say, next() on an empty iterator) must still complete the
    # caller's future: asyncio refuses to set StopIteration on a future, so the caller must not hang.
    def empty_next():
        return next(iter(()))

    async def main():
        try:
            await asyncio.wait_for(handler.submit(empty_next), 2)
        except TimeoutError:
            return "hung"
        except (StopIteration, RuntimeError) as e:
            return type(e).__name__
        return "no error"

    assert run_async(main, exceptions=[]) in {"StopIteration", "RuntimeError"}


def test_num_workers_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        RunHandler(0)


def test_graph_executor_runs_through_the_handler(handler, testdata):
    model = load_saved_model(str(HALF_PLUS_TWO_TF1 / "00000123"))
    executor = GraphExecutor(model)
    x = np.array([[1], [2], [5]], np.float32)

    async def main():
        results = await asyncio.wait_for(
            asyncio.gather(*(handler.submit(executor.run, {"x:0": x + i}, ["y:0"]) for i in range(8))), 60
        )
        with pytest.raises(InvalidArgument, match="float32"):
            await asyncio.wait_for(handler.submit(executor.run, {"x:0": x.astype(np.int32)}, ["y:0"]), 60)
        return results

    try:
        results = run_async(main)
    finally:
        executor.close()
    for i, (y,) in enumerate(results):
        np.testing.assert_array_equal(y, 0.5 * (x + i) + 2)
    assert executor.builds == 1
