"""RunHandler's result hold: under load a worker hands answers back to the event loop together, and never where
that would make a caller wait for another's run."""

from __future__ import annotations

import asyncio
import threading
import time

from servex.executor import RunHandler
from servex.executor.run_handler import Ticket

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


def _second_run_sees_first_answer(handler: RunHandler, wait: float, second: Ticket | None = None, before=None):
    """With the only worker busy, queue a quick first run and a second that waits up to ``wait`` seconds for the
    first's answer to reach the event loop; whether it did (held behind the second run, it cannot).
    ``before``: an async callable run first, on the same loop."""

    async def main():
        if before is not None:
            await before()
        blocker, release, started = _blocked(handler)
        await asyncio.to_thread(started.wait, TIMEOUT)
        first_answered = threading.Event()
        first = handler.submit(lambda: "first")
        first.add_done_callback(lambda f: first_answered.set())
        second_run = handler.submit(lambda: first_answered.wait(wait), ticket=second or Ticket())
        release.set()
        answers = await asyncio.wait_for(asyncio.gather(first, second_run), 2 * TIMEOUT)
        assert answers[0] == "first"
        return answers[1]

    try:
        return asyncio.run(main())
    finally:
        handler.close()


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

    async def high():  # then priority 0: two priorities within the last second
        assert await asyncio.wait_for(handler.submit(lambda: "high", ticket=Ticket(priority=5)), TIMEOUT) == "high"

    assert _second_run_sees_first_answer(handler, TIMEOUT, before=high)


def test_one_priority_is_held():
    """The counterpart of the test above: one priority only, and the first answer waits for the second run."""
    assert not _second_run_sees_first_answer(RunHandler(1, hold_seconds=60.0), 0.5)


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

    async def slow_run():  # the slow model's runs are now known to take long
        await asyncio.wait_for(handler.submit(time.sleep, hold * 2, ticket=slow), TIMEOUT)

    assert _second_run_sees_first_answer(handler, 2, second=slow, before=slow_run)


def test_hold_zero_answers_each_run_on_its_own():
    assert _second_run_sees_first_answer(RunHandler(1, hold_seconds=0), TIMEOUT)
