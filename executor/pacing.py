"""How the RunHandler paces lower priorities while a higher one arrives, so that a saturated event loop does not
make the higher priority wait. A mixin of RunHandler (executor/run_handler.py): it uses the handler's lock,
condition, outboxes and priority state.

With ``lower_priority_burst`` set, while requests of a higher priority arrive (one in the last second),
the workers take lower-priority requests at most that many at a time (a burst), and the next burst only once
the event loop has worked through the last one's answers: a probe put into the loop's queue behind them, as
soon as they are handed back, has come through it. Every call passes through the loop in arrival order, so a
saturated loop, not this queue, is what a high-priority call would wait for; paced, the lower priorities leave
the loop room. Higher-priority runs are never paced, and the probe goes through the loop during them.
"""

from __future__ import annotations

import time

from servex.executor.answers import Outbox

# A pacing probe counts as through the loop's queue after this many loop iterations: its own, then those of the
# callbacks the answers ahead of it scheduled (the callers' tasks), and of theirs. Measured on the MLP
# (bench_priority.py, alternating runs): 8 and 16 gave the same high-priority p99, 16 about 6% less flood; 4 and 2
# a higher p99.
CATCH_UP_ITERATIONS = 8


class Pacing:
    """The RunHandler's pacing of lower priorities (see above)."""

    def _paced(self, level: int, now: float) -> bool:
        """Whether work of priority ``level`` is paced: a higher priority is arriving. The lock is held."""
        return self.lower_priority_burst > 0 and level < self._top and now < self._top_until and not self._stopping

    def _send_due_probes(self) -> None:
        """Once a worker's answers went back: where they ended a lower-priority burst, send the probe now, so that
        it goes through the loop while the worker takes other work (a higher priority's run) instead of after it."""
        for outbox in tuple(self._outboxes.values()):  # a new loop's outbox may be added meanwhile
            if outbox.probe_due:  # else nothing to do (one priority: never), without taking the lock
                with self._cond:
                    self._send_probe(outbox, time.monotonic())

    def _send_probe(self, outbox: Outbox, now: float) -> None:
        """Send a probe into ``outbox``'s loop, behind what it holds, unless one is on its way. The lock is held."""
        outbox.probe_due = False
        if outbox.probe is not None:
            return
        token = outbox.probe = object()
        outbox.probe_sent = now
        try:
            outbox.loop.call_soon_threadsafe(self._probe, outbox, token, CATCH_UP_ITERATIONS)
        except RuntimeError:  # the loop closed: nothing to pace
            self._credit(outbox)

    def _catch_up(self, outbox: Outbox, now: float) -> None:
        """Wait (the lock held, and released while waiting) for the probe through ``outbox``'s loop (sent now if
        none is on its way), and give credit anyway once it is late.

        With several workers, one that finds the credit spent sends the probe at once, without waiting for another
        worker's burst to end: lower-priority runs then start at the pace the loop takes probes, several at once
        where it keeps up. Waiting for each burst's answers would leave all workers but one idle for them."""
        self._send_probe(outbox, now)
        if outbox.credit > 0:
            return
        left = outbox.probe_sent + self.pace_timeout - now
        if left <= 0:  # a stalled loop (a long callback): do not stop the queue for it
            self._credit(outbox)
            return
        self._wait(left)

    def _wait(self, timeout: float | None = None) -> None:
        """Wait on the condition (the lock held, and released while waiting), counted in ``_waiting``."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def _probe(self, outbox: Outbox, token: object, iterations: int) -> None:
        """On the loop: once ``iterations`` loop iterations have passed, the loop has caught up: credit."""
        if iterations > 1:
            outbox.loop.call_soon(self._probe, outbox, token, iterations - 1)
            return
        with self._cond:
            if outbox.probe is token:
                self._credit(outbox)
                self._cond.notify_all()

    def _credit(self, outbox: Outbox) -> None:
        outbox.credit, outbox.probe = self.lower_priority_burst, None
