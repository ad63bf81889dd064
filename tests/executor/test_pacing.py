"""RunHandler's pacing: while a higher priority arrives, lower-priority work starts only as fast as the event loop
works through the answers handed to it, a burst at a time, so that the loop keeps room for the higher priority.

The tests stall the loop (a blocking sleep on the loop thread) and look at which runs started during the stall:
a paced run cannot, since the probe that lets it start has to come through the stalled loop."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from servex.executor import RunHandler
from servex.executor.run_handler import BatchingOptions, DeadlineExceeded, Ticket
from tests.executor.fakes import Busy, Doubler

TIMEOUT = 10
STALL = 0.3
HIGH, LOW = Ticket(priority=5), Ticket(priority=0)


def _run(handler: RunHandler, main):
    try:
        return asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))
    finally:
        handler.close()


def _stall(seconds: float = STALL) -> float:
    """Block the event loop's thread for ``seconds``; returns when the stall ended."""
    time.sleep(seconds)
    return time.monotonic()


def _recorder(starts: list, name):
    return lambda: starts.append((name, time.monotonic()))


def _lows(handler: RunHandler, starts: list, n: int = 3) -> list:
    """Queue ``n`` low-priority runs that record their start in ``starts`` as low0, low1, ..."""
    return [handler.submit(_recorder(starts, f"low{i}"), ticket=LOW) for i in range(n)]


async def _lows_through_a_stall(handler: RunHandler, n: int = 3, stall: float = STALL) -> tuple[list, float]:
    """Queue ``n`` low-priority runs, stall the loop, wait for them: their starts, and when the stall ended."""
    starts: list = []
    lows = _lows(handler, starts, n)
    stall_end = _stall(stall)
    await asyncio.gather(*lows)
    return starts, stall_end


def test_lower_priority_waits_for_the_loop_while_a_higher_priority_arrives():
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        await handler.submit(lambda: None, ticket=HIGH)  # a higher priority is arriving
        starts: list = []
        lows = _lows(handler, starts)
        high = handler.submit(_recorder(starts, "high"), ticket=HIGH)
        stall_end = _stall()
        await asyncio.gather(high, *lows)
        return starts, stall_end

    starts, stall_end = _run(handler, main)
    during = [name for name, t in starts if t < stall_end]
    assert during == ["high"], f"started while the loop was stalled: {during}; the higher priority is never paced"
    assert sorted(name for name, _ in starts) == ["high", "low0", "low1", "low2"]


def test_without_pacing_lower_priority_runs_while_the_loop_is_stalled():
    """The counterpart of the test above (lower_priority_burst=0): the stall itself does not hold runs back."""
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=0)

    async def main():
        await handler.submit(lambda: None, ticket=HIGH)
        return await _lows_through_a_stall(handler)

    starts, stall_end = _run(handler, main)
    assert [name for name, t in starts if t < stall_end] == ["low0", "low1", "low2"]


def test_a_burst_of_lower_priority_runs_per_catch_up_of_the_loop():
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=2, pace_timeout=TIMEOUT)

    async def main():
        loop = asyncio.get_running_loop()
        await handler.submit(lambda: None, ticket=HIGH)
        starts: list = []
        stall_ends: list = []

        def first():  # on the worker: stall the loop behind this run's answer, before the burst's second run
            starts.append(("low0", time.monotonic()))
            loop.call_soon_threadsafe(lambda: stall_ends.append(_stall()))

        lows = [handler.submit(first, ticket=LOW)]
        lows += [handler.submit(_recorder(starts, f"low{i}"), ticket=LOW) for i in range(1, 5)]
        await asyncio.gather(*lows)
        return starts, stall_ends[0]

    starts, stall_end = _run(handler, main)
    assert [name for name, t in starts if t < stall_end] == ["low0", "low1"]  # the burst; then the loop's turn
    assert [name for name, t in starts if t >= stall_end] == ["low2", "low3", "low4"]


def test_the_next_burst_waits_until_the_loop_has_taken_the_last_one_s_answers():
    """The probe goes out behind the burst's answers, not when the burst starts: a long run gives an idle loop
    time to take an early probe, yet here the loop is stalled before this run's answer, and the next run waits."""
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        loop = asyncio.get_running_loop()
        await handler.submit(lambda: None, ticket=HIGH)
        starts: list = []
        stall_ends: list = []

        def low0():
            time.sleep(STALL / 3)
            loop.call_soon_threadsafe(lambda: stall_ends.append(_stall()))

        lows = [handler.submit(low0, ticket=LOW), handler.submit(_recorder(starts, "low1"), ticket=LOW)]
        await asyncio.gather(*lows)
        return starts, stall_ends[0]

    starts, stall_end = _run(handler, main)
    assert [name for name, t in starts if t >= stall_end] == ["low1"]


def test_the_probe_goes_through_the_loop_while_a_higher_priority_runs():
    """The probe goes out as soon as a lower-priority burst's answers are handed back, not when the next burst is
    due: during a long higher-priority run in between, the idle loop takes it. Here the loop is stalled behind
    that run's answer, and the next lower-priority run starts during the stall all the same."""
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        loop = asyncio.get_running_loop()
        await handler.submit(lambda: None, ticket=HIGH)
        started, go = threading.Event(), threading.Event()
        starts: list = []
        stall_ends: list = []

        def low0():
            started.set()
            go.wait(TIMEOUT)

        def high1():  # a long run: the idle loop takes the probe meanwhile; then stall the loop behind its answer
            time.sleep(STALL)
            loop.call_soon_threadsafe(lambda: stall_ends.append(_stall()))

        first = handler.submit(low0, ticket=LOW)
        await asyncio.to_thread(started.wait, TIMEOUT)
        rest = [handler.submit(high1, ticket=HIGH), handler.submit(_recorder(starts, "low1"), ticket=LOW)]
        go.set()
        await asyncio.gather(first, *rest)
        return starts, stall_ends[0]

    starts, stall_end = _run(handler, main)
    assert [name for name, t in starts if t < stall_end] == ["low1"]


def test_a_paced_batch_carries_at_most_the_burst():
    handler = RunHandler(
        1, aging_seconds=0, batching=BatchingOptions(max_batch_size=8), lower_priority_burst=2, pace_timeout=TIMEOUT
    )
    executor = Doubler()
    values = [np.full((1, 3), i, np.float32) for i in range(5)]

    async def main():
        busy = Busy(handler, HIGH)  # holds the worker while the lower-priority requests queue
        await busy.wait_started()
        futures = [handler.submit_batchable(executor, {"x": v}, ["y"], False, LOW) for v in values]
        busy.release.set()
        await busy.future
        return await asyncio.gather(*futures)

    results = _run(handler, main)
    assert executor.runs == [2, 2, 1]  # unpaced, the five would run as one batch of 5 (test_scheduling)
    for value, result in zip(values, results, strict=True):
        np.testing.assert_array_equal(result[0], value * 2)


def test_pacing_ends_a_second_after_the_last_higher_priority_request():
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        await handler.submit(lambda: None, ticket=HIGH)
        await asyncio.sleep(1.1)  # MIXED_PRIORITY_SECONDS: the higher priority no longer counts as arriving
        return await _lows_through_a_stall(handler)

    starts, stall_end = _run(handler, main)
    assert [name for name, t in starts if t < stall_end] == ["low0", "low1", "low2"]


def test_a_stalled_loop_holds_lower_priority_back_at_most_the_pace_timeout():
    timeout = 0.05
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=timeout)

    async def main():
        await handler.submit(lambda: None, ticket=HIGH)
        submitted = time.monotonic()
        # a stall with room for three timeouts and the wake-ups on a slow machine
        starts, stall_end = await _lows_through_a_stall(handler, stall=20 * timeout)
        return starts, submitted, stall_end

    starts, submitted, stall_end = _run(handler, main)
    during = [t for _, t in starts if t < stall_end]
    assert len(during) == 3, "a probe stuck in a stalled loop must not stop the queue"
    assert during[0] >= submitted + timeout  # but each waited for the probe that long first
    assert during[1] >= during[0] + timeout


def test_a_paced_request_whose_deadline_passes_is_answered_deadline_exceeded_and_never_runs():
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        await handler.submit(lambda: None, ticket=HIGH)
        ran: list = []
        late = handler.submit(lambda: ran.append("late"), ticket=Ticket(deadline=time.monotonic() + STALL / 3))
        _stall()  # the deadline passes while the request waits for the loop
        with pytest.raises(DeadlineExceeded, match="the run did not happen"):
            await late
        return ran

    assert _run(handler, main) == []


def test_one_priority_is_never_paced_and_costs_the_loop_no_probe():
    # hold_seconds=0: every answer goes back right after its run, where a worker would send a due probe
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT, hold_seconds=0)

    async def main():
        starts, stall_end = await _lows_through_a_stall(handler, n=5)
        for _ in range(20):  # room for a probe, had one been sent, to come through
            await asyncio.sleep(0)
        outbox = handler._outboxes[asyncio.get_running_loop()]
        return starts, stall_end, (outbox.credit, outbox.probe, outbox.probe_due)

    starts, stall_end, pacing_state = _run(handler, main)
    assert len([name for name, t in starts if t < stall_end]) == 5
    assert pacing_state == (0, None, False), "no probe went through the loop: its credit would show"


def test_aged_lower_priority_waiting_for_the_loop_does_not_hold_up_a_higher_priority():
    """Aging lifts long-waiting low-priority work above a fresh higher priority; paced and without credit, it must
    not keep the worker waiting for the loop while that higher priority could run."""
    handler = RunHandler(1, aging_seconds=0.1, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        busy = Busy(handler, HIGH)
        await busy.wait_started()
        starts: list = []
        lows = _lows(handler, starts)
        await asyncio.sleep(0.7)  # the lows age past priority 5 (one level per 0.1 s)
        high = handler.submit(_recorder(starts, "high"), ticket=HIGH)
        busy.release.set()
        stall_end = _stall()
        await asyncio.gather(busy.future, high, *lows)
        return starts, stall_end

    starts, stall_end = _run(handler, main)
    assert [name for name, t in starts if t < stall_end] == ["high"]


def test_with_several_workers_lower_priority_runs_overlap_where_the_loop_keeps_up():
    """A worker that finds the credit spent sends the probe at once: an idle loop returns it at once, so a second
    lower-priority run starts while the first still runs (pacing slows the flood only where the loop lags)."""
    handler = RunHandler(2, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        await handler.submit(lambda: None, ticket=HIGH)
        events: list = []

        def long_run():
            events.append("low0 started")
            time.sleep(STALL)
            events.append("low0 ended")

        lows = [handler.submit(long_run, ticket=LOW), handler.submit(lambda: events.append("low1 started"), ticket=LOW)]
        await asyncio.gather(*lows)
        return events

    assert _run(handler, main) == ["low0 started", "low1 started", "low0 ended"]


def test_close_does_not_wait_for_a_probe():
    handler = RunHandler(1, aging_seconds=0, lower_priority_burst=1, pace_timeout=TIMEOUT)

    async def main():
        await handler.submit(lambda: None, ticket=HIGH)
        starts: list = []
        lows = _lows(handler, starts)
        began = time.monotonic()
        handler.close()  # on the loop's thread: no probe can come through while it waits for the workers
        took = time.monotonic() - began
        await asyncio.gather(*lows)
        return starts, took

    starts, took = _run(handler, main)
    assert [name for name, _ in starts] == ["low0", "low1", "low2"]  # queued work still runs at close
    assert took < TIMEOUT / 2, f"close took {took:.1f}s: it waited for the pacing timeout"
