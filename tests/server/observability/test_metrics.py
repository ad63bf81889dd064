"""server/observability/metrics.py: the event loop's lag, sampled from the loop itself."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from servex.server.observability.metrics import watch_loop_lag


def _lag() -> tuple[float, float]:
    count = REGISTRY.get_sample_value("servex_event_loop_lag_seconds_count") or 0.0
    return count, REGISTRY.get_sample_value("servex_event_loop_lag_seconds_sum") or 0.0


def test_a_stalled_loop_shows_as_lag():
    stall = 0.3

    async def main():
        watcher = asyncio.ensure_future(watch_loop_lag(interval=0.05))
        await asyncio.sleep(0.01)  # the watcher's timer is set
        before = _lag()
        time.sleep(stall)  # the loop's thread is busy: the timer fires late
        await asyncio.sleep(0.2)  # the late sample, then a few prompt ones
        watcher.cancel()
        return before, _lag()

    (count0, sum0), (count1, sum1) = asyncio.run(main())
    assert count1 >= count0 + 2
    assert sum1 - sum0 >= stall - 0.05 - 0.01, "the stall must show: the timer was due 0.05 s in, it ran at 0.3 s"
    assert sum1 - sum0 < stall + 0.15  # and only it: an idle loop runs its timers on time
