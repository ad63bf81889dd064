"""RunHandler's result hold: under load a worker hands answers back to the event loop together, and never where
that would make a caller wait for another's run."""

from __future__ import annotations

import asyncio
import threading
import time

from executor import RunHandler
from executor.run_handler import Ticket

TIMEOUT = 10


class Iterations:
    """Counts the event loop's iterations: a callback that schedules itself again runs once per iteration."""

    def __init__(self):
        self.count = 0
        self._stopped = False
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self):
        self.count += 1
        if not self._stopped:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self):
        self._stopped = True


def _blocked(handler: RunHandler, ticket: Ticket | None = None):
    """Occupies the handler's only worker until the returned event is set."""
    release, started = threading.Event(), threading.Event()

    def block():
        started.set()
        release.wait(TIMEOUT)

    return handler.submit(block, ticket=ticket or Ticket()), release, started


def test_answers_of_queued_short_runs_come_back_in_one_loop_iteration():
    handler = RunHandler(1, hold_seconds=5.0)

    async def main():
        iterations = Iterations()
        blocker, release, started = _blocked(handler)
        await asyncio.to_thread(started.wait, TIMEOUT)
        arrived = {}

        def run(i):
            time.sleep(0.005)  # long enough for an idle loop to take an answer handed back on its own
            return i * i

        futures = [handler.submit(run, i) for i in range(6)]
        for i, f in enumerate(futures):
            f.add_done_callback(lambda f, i=i: arrived.__setitem__(i, iterations.count))
        release.set()
        results = await asyncio.wait_for(asyncio.gather(blocker, *futures), TIMEOUT)
        iterations.stop()
        return results[1:], arrived

    try:
        results, arrived = asyncio.run(main())
    finally:
        handler.close()
    assert results == [i * i for i in range(6)]
    assert len(set(arrived.values())) == 1, f"answers arrived in loop iterations {arrived}"


def test_a_lone_request_is_answered_at_once_however_long_the_hold():
    handler = RunHandler(1, hold_seconds=60.0)

    async def main():
        for i in range(3):  # nothing else waits: each answer goes back right after its run
            assert await asyncio.wait_for(handler.submit(lambda i=i: i + 1), 2) == i + 1

    try:
        asyncio.run(main())
    finally:
        handler.close()


def test_nothing_is_held_while_requests_of_several_priorities_arrive():
    handler = RunHandler(1, hold_seconds=60.0, aging_seconds=0)

    async def main():
        assert await asyncio.wait_for(handler.submit(lambda: "high", ticket=Ticket(priority=5)), TIMEOUT) == "high"
        blocker, release, started = _blocked(handler)  # priority 0 now: two priorities within the last second
        await asyncio.to_thread(started.wait, TIMEOUT)
        first_answered = threading.Event()
        first = handler.submit(lambda: "first")
        first.add_done_callback(lambda f: first_answered.set())
        # The second run finishes only once the first answer reached the loop: held, it would not come back in time.
        second = handler.submit(lambda: first_answered.wait(TIMEOUT))
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, second), 2 * TIMEOUT)

    try:
        assert asyncio.run(main()) == ["first", True]
    finally:
        handler.close()


def test_one_priority_is_held():
    """The counterpart of the test above: one priority only, and the first answer waits for the second run."""
    handler = RunHandler(1, hold_seconds=60.0)

    async def main():
        blocker, release, started = _blocked(handler)
        await asyncio.to_thread(started.wait, TIMEOUT)
        first_answered = threading.Event()
        first = handler.submit(lambda: "first")
        first.add_done_callback(lambda f: first_answered.set())
        second = handler.submit(lambda: first_answered.wait(0.5))
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, second), 2 * TIMEOUT)

    try:
        assert asyncio.run(main()) == ["first", False]
    finally:
        handler.close()


def test_an_answer_is_held_at_most_the_hold_time():
    hold = 0.05
    handler = RunHandler(1, hold_seconds=hold)

    async def main():
        blocker, release, started = _blocked(handler)
        await asyncio.to_thread(started.wait, TIMEOUT)
        starts: list[float] = []

        def short_run():
            starts.append(time.monotonic())
            time.sleep(hold / 5)  # short: under the hold, so answers are kept while more work waits

        futures = [handler.submit(short_run) for _ in range(15)]
        answered: list[float] = []
        futures[0].add_done_callback(lambda f: answered.append(time.monotonic()))
        release.set()
        await asyncio.wait_for(asyncio.gather(blocker, *futures), TIMEOUT)
        return starts, answered[0]

    try:
        starts, first_answered = asyncio.run(main())
    finally:
        handler.close()
    # 15 runs of hold/5 take 3 holds; the first answer went back once it had been held a hold, long before the
    # last run started.
    assert first_answered < starts[-1], "the first answer waited for every queued run"
    assert first_answered - starts[0] < hold * 3


def test_short_answers_never_wait_behind_a_run_known_to_be_long():
    hold = 0.1
    handler = RunHandler(1, hold_seconds=hold)
    slow = Ticket(labels=("slow", "1", "serving_default"))

    async def main():
        await asyncio.wait_for(handler.submit(time.sleep, hold * 2, ticket=slow), TIMEOUT)  # its runs take long
        blocker, release, started = _blocked(handler)
        await asyncio.to_thread(started.wait, TIMEOUT)
        first_answered = threading.Event()
        first = handler.submit(lambda: "short")
        first.add_done_callback(lambda f: first_answered.set())
        # The slow model's next run ends once the short answer reached the loop: held behind it, it never would.
        second = handler.submit(lambda: first_answered.wait(2), ticket=slow)
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, second), TIMEOUT)

    try:
        assert asyncio.run(main()) == ["short", True]
    finally:
        handler.close()


def test_hold_zero_answers_each_run_on_its_own():
    handler = RunHandler(1, hold_seconds=0)

    async def main():
        blocker, release, started = _blocked(handler)
        await asyncio.to_thread(started.wait, TIMEOUT)
        gate = threading.Event()
        first = handler.submit(lambda: "first")
        # The second run waits until the first answer reached the loop, which only an unheld answer does.
        second = handler.submit(lambda: gate.wait(TIMEOUT))
        first.add_done_callback(lambda f: gate.set())
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, second), 2 * TIMEOUT)

    try:
        assert asyncio.run(main()) == ["first", True]
    finally:
        handler.close()
