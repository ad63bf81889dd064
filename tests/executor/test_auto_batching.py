"""The RunHandler's automatic batching: a graph batches only once its first batch answered as its requests do
alone, a compute-bound graph runs as many runs at once as the handler allows it (in batches), and its choices
show in the gauges."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
from prometheus_client import REGISTRY

from servex.executor import client_graph
from servex.executor.batching import program_rows
from servex.executor.cost_model import COMPUTE_BOUND_RUNS, VERIFY_REQUESTS
from servex.executor.run_handler import BatchingOptions, RunHandler, Ticket
from servex.loader.errors import InvalidArgument
from tests.executor.fakes import Busy, Doubler, batched, run

AUTO = BatchingOptions(max_batch_size=32, auto=True)


def served(handler: RunHandler, main):
    """``main()`` run on a fresh loop, the handler closed after it; what it returned."""
    try:
        return run(main())
    finally:
        handler.close()


class MeanRemover(Doubler):
    """Answers x minus the batch's mean: its rows depend on each other, so batching changes its answers."""

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        x = feeds["x"]
        self.runs.append(x.shape[0])
        return [x - x.mean(axis=0)]


class OneRowOnly(Doubler):
    """A graph with a fixed batch size of one row: TensorFlow refuses any other."""

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        if feeds["x"].shape[0] != 1:
            raise InvalidArgument(f"expected shape [1,3], got {list(feeds['x'].shape)}")
        return super().run(feeds, fetches)


class Slow(Doubler):
    """Takes 5 ms a run whatever its rows (compute-bound by the cost model's measure), counting runs at once."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.now = self.most = 0

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.005)
        with self.lock:
            self.now -= 1
        return super().run(feeds, fetches)


def rows(n: int, value: float = 1.0) -> list[np.ndarray]:
    return [np.full((1, 3), value + i, np.float32) for i in range(n)]


def twice(executor, values):
    """The same requests queued together twice, with automatic batching: both answers, and the runs the first
    time took."""
    handler = RunHandler(1, batching=AUTO)
    try:
        first = batched(handler, executor, values)
        runs = len(executor.runs)
        return first, batched(handler, executor, values), runs
    finally:
        handler.close()


def test_a_graph_batches_once_its_first_batch_answered_as_its_requests_do_alone():
    executor = Doubler()
    values = rows(6)
    first, second, _ = twice(executor, values)
    # First: the batch of 6, then its first requests alone to check; then a batch of 6 with no check.
    assert executor.runs == [6, *[1] * VERIFY_REQUESTS, 6]
    for results in (first, second):
        for value, (answer,) in zip(values, results, strict=True):
            np.testing.assert_array_equal(answer, value * 2)


def test_a_graph_whose_rows_depend_on_each_other_never_batches_and_answers_as_alone():
    executor = MeanRemover()
    first, second, runs = twice(executor, rows(6))
    assert executor.runs[0] == 6 and set(executor.runs[1:]) == {1}
    assert executor.runs[runs:] == [1] * 6  # later requests run one by one
    for results in (first, second):
        for (answer,) in results:
            np.testing.assert_array_equal(answer, np.zeros((1, 3), np.float32))  # alone, x minus its own mean


def test_a_graph_that_refuses_a_batch_its_requests_run_alone_in_stops_batching():
    executor = OneRowOnly()
    values = rows(4)
    first, second, _ = twice(executor, values)
    assert executor.runs == [1] * 8  # the refused batch never ran; each request alone, twice
    assert [a[0].tolist() for a in first] == [a[0].tolist() for a in second] == [(v * 2).tolist() for v in values]


def test_a_batch_refused_for_one_callers_bad_input_keeps_the_graph_batching():
    handler = RunHandler(1, batching=AUTO)
    executor = OneRowOnly()
    values = [np.ones((1, 3), np.float32), np.ones((2, 3), np.float32)]  # the second fails alone too

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        futures = [handler.submit_batchable(executor, {"x": v}, ["y"], False, Ticket()) for v in values]
        busy.release.set()
        await busy.future
        return await asyncio.gather(*futures, return_exceptions=True)

    good, bad = served(handler, main)
    np.testing.assert_array_equal(good[0], values[0] * 2)
    assert isinstance(bad, InvalidArgument) and "expected shape [1,3], got [2, 3]" in str(bad)
    (cost,) = handler._costs[executor].graphs.values()
    assert cost.verified is None  # not judged on one caller's bad input: the graph may still batch


def test_with_one_compute_bound_run_a_graph_runs_one_run_at_a_time_in_batches_and_shows_its_choice():
    handler = RunHandler(3, batching=AUTO, intra_op_threads=2, compute_bound_runs=1)
    executor = Slow()
    labels = {"model": "slow", "version": "1", "signature": "serving_default"}
    ticket = Ticket(model="slow", labels=("slow", "1", "serving_default"))

    async def main():
        for _ in range(3):  # learns: 5 ms a row
            await handler.submit_batchable(executor, {"x": rows(1)[0]}, ["y"], False, ticket)
        futures = []
        for v in rows(24):  # one at a time, while earlier ones run: free workers would take each at once
            futures.append(handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket))
            await asyncio.sleep(0.001)
        return await asyncio.gather(*futures)

    results = served(handler, main)
    assert executor.most == 1  # never two runs at once, with three workers free
    assert len(executor.runs) < 3 + 24  # and its requests ran in batches
    assert [r[0].tolist() for r in results] == [(v * 2).tolist() for v in rows(24)]
    gauge = REGISTRY.get_sample_value
    assert gauge("servex_scheduler_compute_bound", labels) == 1
    assert gauge("servex_scheduler_concurrency", labels) == 1
    assert 1 <= gauge("servex_scheduler_batch_limit", labels) <= 32
    assert gauge("servex_scheduler_intra_op_threads", labels) == 2  # its version session's


def test_a_compute_bound_graph_runs_twice_at_once_on_a_worker_started_for_it():
    # The default (COMPUTE_BOUND_RUNS, two): runs at once beyond the one worker a call-bound graph keeps.
    handler = RunHandler(1, batching=AUTO, intra_op_threads=2)
    executor = Slow()
    labels = {"model": "slow2", "version": "1", "signature": "serving_default"}
    ticket = Ticket(model="slow2", labels=("slow2", "1", "serving_default"))

    async def main():
        for _ in range(3):  # learns: 5 ms a row, compute-bound
            await handler.submit_batchable(executor, {"x": rows(1)[0]}, ["y"], False, ticket)
        futures = []
        for v in rows(40):
            futures.append(handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket))
            await asyncio.sleep(0.001)
        return await asyncio.gather(*futures)

    try:
        assert len(handler._threads) == 1
        results = run(main())
        threads = len(handler._threads)
    finally:
        handler.close()
    assert COMPUTE_BOUND_RUNS > 1
    assert threads == COMPUTE_BOUND_RUNS  # workers started once the graph was found compute-bound
    assert executor.most == COMPUTE_BOUND_RUNS  # that many runs at once, never more
    assert len(executor.runs) < 3 + 40  # in batches
    assert [r[0].tolist() for r in results] == [(v * 2).tolist() for v in rows(40)]
    assert REGISTRY.get_sample_value("servex_scheduler_concurrency", labels) == COMPUTE_BOUND_RUNS


def test_a_call_bound_graph_starts_no_worker_for_compute_bound_runs():
    handler = RunHandler(1, batching=AUTO)
    executor = Doubler()
    ticket = Ticket(labels=("fast2", "1", "serving_default"))

    async def main():
        return await asyncio.gather(
            *[handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket) for v in rows(20)]
        )

    try:
        run(main())
        threads = len(handler._threads)
    finally:
        handler.close()
    labels = {"model": "fast2", "version": "1", "signature": "serving_default"}
    assert REGISTRY.get_sample_value("servex_scheduler_compute_bound", labels) == 0
    assert REGISTRY.get_sample_value("servex_scheduler_concurrency", labels) == 1
    assert threads == 1


def test_a_call_bound_graph_may_run_on_every_worker():
    handler = RunHandler(3, batching=AUTO)
    executor = Doubler()
    ticket = Ticket(labels=("fast", "1", "serving_default"))

    async def main():
        await handler.submit_batchable(executor, {"x": rows(1)[0]}, ["y"], False, ticket)

    served(handler, main)
    labels = {"model": "fast", "version": "1", "signature": "serving_default"}
    assert REGISTRY.get_sample_value("servex_scheduler_compute_bound", labels) == 0
    assert REGISTRY.get_sample_value("servex_scheduler_concurrency", labels) == 3


def test_each_batch_reports_the_rows_that_waited_for_its_graph_when_it_was_taken():
    # The load on a graph, for its runs at once (executor/runs_at_once.py): a batch's rows and those left queued.
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=4, auto=True))
    executor = Doubler()
    ticket = Ticket()
    seen = []

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        futures = [handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket) for v in rows(10)]
        (cost,) = handler._costs[executor].graphs.values()
        observe = cost.observe

        def recording(n, seconds, at_once=1.0, waiting=0, ended=None, one_thread=False, compiled=False, load=0):
            if waiting:  # (the first batch's check runs its requests alone too: those report none)
                seen.append((n, waiting, load))
            return observe(n, seconds, at_once, waiting, ended, one_thread, compiled, load)

        cost.observe = recording
        busy.release.set()
        await busy.future
        return await asyncio.gather(*futures)

    results = served(handler, main)
    assert [r[0].tolist() for r in results] == [(v * 2).tolist() for v in rows(10)]
    # One worker: no other run's rows, so its load (the cost model's) is the rows that waited.
    assert seen == [(4, 10, 10), (4, 6, 6), (2, 2, 2)]


class AloneRecorder(Doubler):
    """Records each run's rows and whether the run handler said it goes alone."""

    def __init__(self):
        super().__init__()
        self.alone: list[tuple[int, bool]] = []

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        self.alone.append((feeds["x"].shape[0], alone))
        return super().run(feeds, fetches)


def test_only_one_request_with_nothing_beside_it_goes_alone():
    # One run at a time: a batch that took every queued request leaves nothing queued, but its requests came from
    # several callers (a load): it goes on its worker, not where a lone request's runs go (TensorFlow's inter-op
    # pool, client_graph.py), whose ops spread over cores that the calls need under load.
    handler = RunHandler(1, batching=AUTO)
    executor = AloneRecorder()
    ticket = Ticket()

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        futures = [handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket) for v in rows(4)]
        busy.release.set()
        await busy.future
        await asyncio.gather(*futures)
        return await handler.submit_batchable(executor, {"x": rows(1)[0]}, ["y"], False, ticket)

    assert served(handler, main)[0].tolist() == (rows(1)[0] * 2).tolist()
    # The batch of four, then its check's runs one by one (never alone), then the request alone.
    assert executor.alone == [(4, False)] + [(1, False)] * VERIFY_REQUESTS + [(1, True)]


class Meeting(Doubler):
    """Each run waits (up to 10 s) until ``parties`` runs are going at once, so that two workers' batches are taken
    while the other's run goes."""

    def __init__(self, parties: int):
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=10)

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        result = super().run(feeds, fetches)
        self.barrier.wait()
        return result


def test_a_graph_in_one_thread_lanes_splits_its_queued_rows_between_its_lanes():
    # Ten rows queued for a graph whose runs go in the one-thread session two at once: each worker's batch takes
    # its lane's share (5), not every queued row (which would leave the other lane idle: the barrier breaks).
    handler = RunHandler(2, batching=AUTO, intra_op_threads=2)
    executor = Meeting(2)
    ticket = Ticket()

    async def main():
        first, second = Busy(handler), Busy(handler)
        await first.wait_started()
        await second.wait_started()
        futures = [handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket) for v in rows(10)]
        (cost,) = handler._costs[executor].graphs.values()
        cost.observe = lambda *args, load, **kwargs: loads.append(load)  # its runs one-thread, as learned
        cost.verified, cost.run_threads, cost.concurrency = True, 1, 2
        first.release.set()
        second.release.set()
        return await asyncio.gather(*futures)

    loads = []
    results = served(handler, main)
    assert [r[0].tolist() for r in results] == [(v * 2).tolist() for v in rows(10)]
    assert executor.runs == [5, 5]
    # Each batch's load, for the cost model: the graph's rows in the scheduler when it was taken. The first's, its
    # own and the five left queued; the second's, its own and the first's five running.
    assert loads == [10, 10]


class Gated(Doubler):
    """Its first run waits (up to 10 s) for ``release``; every run records the worker it went on."""

    def __init__(self):
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()
        self.workers: list[str] = []

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        self.workers.append(threading.current_thread().name)
        if len(self.workers) == 1:
            self.started.set()
            assert self.release.wait(10)
        return super().run(feeds, fetches)


def test_a_graph_that_runs_one_at_a_time_wakes_no_other_worker_and_keeps_its_runs_on_one():
    # A compute-bound graph one run at a time (its trial's choice), two workers: the idle one is woken neither by the
    # requests that queue behind the run (it could not run them) nor at the run's end (the worker that ran it takes
    # the next batch itself). Each such wake-up is a thread switch for nothing, beside the run and the event loop.
    handler = RunHandler(2, batching=AUTO)
    executor = Gated()
    ticket = Ticket()
    notified = []

    async def main():
        first = handler.submit_batchable(executor, {"x": rows(1)[0]}, ["y"], False, ticket)
        await asyncio.get_running_loop().run_in_executor(None, executor.started.wait, 10)
        (cost,) = handler._costs[executor].graphs.values()
        cost.observe = lambda *args, **kwargs: None  # one at a time, as learned
        cost.verified, cost.concurrency = True, 1
        while handler._waiting != 1:  # the other worker waits for work
            await asyncio.sleep(0.001)
        notify = handler._cond.notify
        handler._cond.notify = lambda n=1: (notified.append(n), notify(n))
        queued = [handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket) for v in rows(4, 2.0)]
        executor.release.set()
        results = await asyncio.gather(first, *queued)
        del handler._cond.notify  # (closing wakes every worker)
        return results

    results = served(handler, main)
    assert [r[0].tolist() for r in results] == [(v * 2).tolist() for v in rows(1) + rows(4, 2.0)]
    assert executor.runs == [1, 4]  # the four queued behind the run went as one batch
    assert notified == []
    assert executor.workers[0] == executor.workers[1]


class GatedThenMeeting(Gated):
    """Its first run waits for ``release``; the later ones each wait (up to 5 s) for another to be going."""

    def __init__(self):
        super().__init__()
        self.barrier = threading.Barrier(2, timeout=5)

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        later = bool(self.workers)
        result = super().run(feeds, fetches)
        if later:
            self.barrier.wait()
        return result


def test_a_graph_whose_runs_at_once_rose_while_its_requests_queued_wakes_a_worker_at_its_run_s_end():
    # One at a time while four requests queued behind its run (no worker woken for them), then two at once (a
    # trial's next phase): the run's end wakes the other worker, and the queued batches go two at once.
    handler = RunHandler(2, batching=BatchingOptions(max_batch_size=2, auto=True))
    executor = GatedThenMeeting()
    ticket = Ticket()

    async def main():
        first = handler.submit_batchable(executor, {"x": rows(1)[0]}, ["y"], False, ticket)
        await asyncio.get_running_loop().run_in_executor(None, executor.started.wait, 10)
        (cost,) = handler._costs[executor].graphs.values()
        cost.observe = lambda *args, **kwargs: None
        cost.verified, cost.concurrency = True, 1
        while handler._waiting != 1:
            await asyncio.sleep(0.001)
        queued = [handler.submit_batchable(executor, {"x": v}, ["y"], False, ticket) for v in rows(4, 2.0)]
        cost.concurrency = 2
        executor.release.set()
        return await asyncio.gather(first, *queued)

    results = served(handler, main)
    assert [r[0].tolist() for r in results] == [(v * 2).tolist() for v in rows(1) + rows(4, 2.0)]
    assert executor.runs == [1, 2, 2]
    assert len(set(executor.workers[1:])) == 2  # the two batches went at once, on both workers


class Compiled(Doubler):
    """A graph whose runs take XLA's programs (client_graph.py says so for each run, as LoadedClientGraph.run does),
    recording each run's feed."""

    def __init__(self):
        super().__init__()
        self.fed: list[np.ndarray] = []

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        client_graph._RAN.compiled = True
        self.fed.append(feeds["x"])
        return super().run(feeds, fetches)


def test_a_graph_on_xlas_programs_pads_its_batches_to_a_few_sizes_once_batching_was_checked():
    # XLA compiles a program per batch size: batches of 5 and 9 rows run as 6 and 12, padded with copies of the last
    # row (each answer its own rows); the first batch, before batching's check, and a batch of one are not padded.
    executor = Compiled()
    five, nine = rows(5), rows(9, 10.0)
    first, second, runs = twice(executor, five)
    assert executor.runs[:runs] == [5, *[1] * VERIFY_REQUESTS]
    assert executor.runs[runs:] == [program_rows(5, 32)] == [6]
    np.testing.assert_array_equal(executor.fed[-1][5:], five[-1])  # the last row, again
    for results in (first, second):
        for value, (answer,) in zip(five, results, strict=True):
            np.testing.assert_array_equal(answer, value * 2)
    handler = RunHandler(1, batching=AUTO)
    try:
        batched(handler, executor, nine)
        again = batched(handler, executor, nine)
        assert executor.runs[-1] == 12
        for value, (answer,) in zip(nine, again, strict=True):
            np.testing.assert_array_equal(answer, value * 2)
        assert batched(handler, executor, rows(1)) and executor.runs[-1] == 1
    finally:
        handler.close()


def test_the_sizes_a_compiled_graphs_batches_take():
    assert [program_rows(n, 32) for n in range(1, 33)] == [
        1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, *[24] * 8, *[32] * 8
    ]  # fmt: skip
    assert all(n <= program_rows(n, 1024) < n * 3 / 2 for n in range(1, 1025))  # under half again as many rows
    assert program_rows(17, 20) == 20 and program_rows(40, 32) == 40  # the largest batch bounds it, not below rows
