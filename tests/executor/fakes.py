"""Stand-ins the RunHandler tests share: a request that holds the worker, a GraphExecutor that doubles its input,
and a way to queue requests behind a busy worker so that they batch."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from servex.executor.run_handler import RunHandler, Ticket


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Busy:
    """Holds the (single) worker until released."""

    def __init__(self, handler: RunHandler, ticket: Ticket | None = None):
        self.started, self.release = threading.Event(), threading.Event()
        self.future = handler.submit(self._hold, ticket=ticket or Ticket())

    def _hold(self):
        self.started.set()
        assert self.release.wait(10)

    async def wait_started(self):
        await asyncio.get_running_loop().run_in_executor(None, self.started.wait, 10)


class Doubler:
    """A GraphExecutor stand-in for scheduling tests: run() doubles 'x' and records each run's rows."""

    def __init__(self, scalar_output: bool = False):
        self.runs: list[int] = []
        self.scalar_output = scalar_output

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        x = feeds["x"]
        self.runs.append(x.shape[0])
        return [np.float32(x.sum())] if self.scalar_output else [x * 2]


def batched(handler, executor, values, priorities=None, shapes_differ=False):
    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        futures = []
        for i, value in enumerate(values):
            ticket = Ticket(priority=priorities[i] if priorities else 0)
            futures.append(handler.submit_batchable(executor, {"x": value}, ["y"], False, ticket))
        busy.release.set()
        await busy.future
        return await asyncio.gather(*futures)

    return run(main())
