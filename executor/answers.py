"""Answers on their way from the RunHandler's workers back to the callers' event loops.

``Outbox``: one per event loop; a worker adds results, and one wake-up of the loop (``call_soon_threadsafe``)
delivers all that are ready. It also carries the loop's pacing state, which the RunHandler keeps. ``Held``: a
worker's finished results kept back for a moment while more work waits, so that several answers share a wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

log = logging.getLogger(__name__)


def deliver(future: asyncio.Future, ok: bool, value) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(value)
    elif isinstance(value, StopIteration):  # asyncio refuses to carry StopIteration through a future
        future.set_exception(RuntimeError(f"run raised StopIteration: {value!r}"))
    else:
        future.set_exception(value)


class Outbox:
    """Results on their way back to one event loop: one wake-up of the loop carries all that are ready.

    Under load the cross-thread hand-off, not TensorFlow, is what costs most per request; a worker that finds
    the outbox already scheduled for delivery just adds its result.

    It also carries the loop's pacing state (guarded by the RunHandler's lock): ``credit``, the lower-priority
    requests the workers may still start before the loop must catch up; ``probe_due``, set when a burst used the
    last of it (the probe goes once the burst's answers are handed back); ``probe``, the token of the catch-up
    probe on its way through the loop (None when none is), sent at ``probe_sent``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._results: list = []
        self.credit = 0
        self.probe: object | None = None
        self.probe_sent = 0.0
        self.probe_due = False

    def put(self, future: asyncio.Future, ok: bool, value) -> None:
        self.put_many([(future, ok, value)])

    def put_many(self, results: list) -> None:
        with self._lock:
            first = not self._results
            self._results.extend(results)
        if first:
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop closed during shutdown; nobody is waiting any more
                log.debug("a run finished after its event loop closed")

    def _flush(self) -> None:
        with self._lock:
            results, self._results = self._results, []
        for future, ok, value in results:
            deliver(future, ok, value)


class Held:
    """A worker's finished results not yet handed back to their event loops.

    Each hand-back wakes a loop, and under load those wake-ups, not TensorFlow, are most of what a request costs.
    So while more work waits, a worker keeps the results of short runs and hands them back together, once the
    first has waited ``hold_seconds`` (at the end of the run then in progress). Everything goes back at once when
    nothing waits (a lone caller waits for nothing), after a run that took ``hold_seconds`` or more, and before a
    run whose last run (same model, version, signature and priority) took that long: short answers never wait
    behind a long run.

    Nothing is held while requests of more than one priority arrive (within the RunHandler's
    ``MIXED_PRIORITY_SECONDS`` of the last change of priority): holding makes the workers faster than the event
    loop, so the backlog moves out of this queue, where priority orders it, into gRPC's, where arrival does, and a
    high-priority caller waits behind all of it (measured on the MLP: its p99 under a flood went from 3 to 8 ms).
    One priority: speed; several: isolation.
    """

    def __init__(self, hold_seconds: float):
        self.hold_seconds = hold_seconds
        self.results: dict[Outbox, list] = {}
        self.since = 0.0

    def add(self, outbox: Outbox, future: asyncio.Future, ok: bool, value) -> None:
        if not self.results:
            self.since = time.monotonic()
        self.results.setdefault(outbox, []).append((future, ok, value))

    def before(self, now: float, expected: float) -> None:
        """Before a run starting ``now`` that may take ``expected`` (what the last of its kind took)."""
        if self.results and (now - self.since >= self.hold_seconds or expected >= self.hold_seconds):
            self.hand_back()

    def after(self, started: float, mixed: bool) -> None:
        """After the run that began at ``started``; ``mixed``: requests of several priorities are arriving."""
        if self.results and (mixed or time.monotonic() - started >= self.hold_seconds):
            self.hand_back()

    def hand_back(self) -> None:
        results, self.results = self.results, {}
        for outbox, ready in results.items():
            outbox.put_many(ready)
