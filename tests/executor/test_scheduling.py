"""The RunHandler's scheduling: priorities, aging, deadlines, cancellation, the queue bound, batching."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from servex.executor import GraphExecutor
from servex.executor.run_handler import BatchingOptions, DeadlineExceeded, RunHandler, Ticket
from servex.loader import load_saved_model
from servex.loader.errors import ResourceExhausted
from tests.conftest import HALF_PLUS_TWO_TF1
from tests.executor.fakes import Busy, Doubler, batched, run


def test_priority_order_while_the_worker_is_busy():
    handler = RunHandler(1, aging_seconds=0)
    order = []

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        futures = [
            handler.submit(order.append, label, ticket=Ticket(priority=p))
            for label, p in [("a0", 0), ("b5", 5), ("c1", 1), ("d5", 5), ("e-1", -1)]
        ]
        busy.release.set()
        await asyncio.gather(busy.future, *futures)

    try:
        run(main())
    finally:
        handler.close()
    assert order == ["b5", "d5", "c1", "a0", "e-1"]  # larger first; equal priorities keep arrival order


@pytest.mark.parametrize("aging, expected", [(0.02, ["old-low", "new-high"]), (0, ["new-high", "old-low"])])
def test_waiting_work_ages(aging, expected):
    handler = RunHandler(1, aging_seconds=aging)
    order = []

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        low = handler.submit(order.append, "old-low", ticket=Ticket(priority=0))
        await asyncio.sleep(0.3)  # 0.3 s of waiting is worth 15 priority levels at 20 ms each
        high = handler.submit(order.append, "new-high", ticket=Ticket(priority=3))
        busy.release.set()
        await asyncio.gather(busy.future, low, high)

    try:
        run(main())
    finally:
        handler.close()
    assert order == expected


def test_a_request_whose_deadline_passes_in_the_queue_never_runs():
    handler = RunHandler(1)
    ran = []

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        doomed = handler.submit(ran.append, "doomed", ticket=Ticket(deadline=time.monotonic() + 0.3))
        fine = handler.submit(ran.append, "fine", ticket=Ticket(deadline=time.monotonic() + 30))
        await asyncio.sleep(0.6)
        busy.release.set()
        with pytest.raises(DeadlineExceeded) as info:
            await doomed
        await fine
        return info.value

    try:
        error = run(main())
    finally:
        handler.close()
    assert ran == ["fine"]
    assert error.code == "DEADLINE_EXCEEDED" and "did not happen" in error.message
    # The message says where the time went: waiting in the queue, with how long it had left when queued.
    waited = re.search(
        r"while the request waited in the run queue: queued (\d+\.\d+)s with (\d+\.\d+)s left", error.message
    )
    assert waited, error.message
    assert float(waited[1]) >= 0.3 and 0.0 < float(waited[2]) <= 0.3


def test_a_request_whose_deadline_passed_before_it_was_queued_is_answered_at_once():
    handler = RunHandler(1)
    ran = []
    done = Done()
    ticket = Ticket(deadline=time.monotonic() - 0.25, model="late", labels=("late", "1", "sig"), done=done)
    metric = ("servex_deadline_exceeded_total", {"model": "late", "version": "1", "signature": "sig", "priority": "0"})
    before = REGISTRY.get_sample_value(*metric) or 0.0

    async def main():
        busy = Busy(handler)  # the worker is busy, yet the answer comes at once: it never waits in the queue
        await busy.wait_started()
        with pytest.raises(DeadlineExceeded) as info:
            handler.submit(ran.append, "late", ticket=ticket)
        queued = dict(handler._queued)
        busy.release.set()
        await busy.future
        return info.value, queued

    try:
        error, queued = run(main())
    finally:
        handler.close()
    assert ran == [] and queued.get("late", 0) == 0
    assert error.code == "DEADLINE_EXCEEDED"
    assert "before the request reached the run queue" in error.message and "did not happen" in error.message
    assert float(re.search(r"had passed (\d+\.\d+)s before", error.message)[1]) >= 0.25
    assert "in the queue" not in error.message
    assert done.calls == 1  # the version's lease is let go
    assert REGISTRY.get_sample_value(*metric) == before + 1


def test_a_cancelled_request_is_dropped():
    handler = RunHandler(1)
    ran = []

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        gone = handler.submit(ran.append, "gone")
        kept = handler.submit(ran.append, "kept")
        gone.cancel()
        busy.release.set()
        await asyncio.gather(busy.future, kept)

    try:
        run(main())
    finally:
        handler.close()
    assert ran == ["kept"]


def test_a_full_queue_answers_resource_exhausted_at_once():
    handler = RunHandler(1, max_queued_per_model=2)

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        queued = [handler.submit(lambda: 1, ticket=Ticket(model="m")) for _ in range(2)]
        with pytest.raises(ResourceExhausted, match="'m'.*2 requests are queued"):
            handler.submit(lambda: 1, ticket=Ticket(model="m"))
        other = handler.submit(lambda: 2, ticket=Ticket(model="other"))  # the bound is per model
        busy.release.set()
        return await asyncio.gather(*queued, other)

    try:
        assert run(main()) == [1, 1, 2]
    finally:
        handler.close()


def test_queued_input_bytes_are_bounded_across_models():
    handler = RunHandler(1, max_queued_bytes=1000, batching=BatchingOptions(8))
    executor = Doubler()
    row = np.zeros((1, 100), np.float32)  # 400 bytes
    strings = np.array([b"x" * 300], dtype=object)  # its pointer and its 300 bytes

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        first = handler.submit_batchable(executor, {"x": row}, ["y"], False, Ticket(model="a"))
        second = handler.submit(lambda: "ran", ticket=Ticket(model="b"), inputs={"t": np.zeros(500, np.uint8)})
        with pytest.raises(ResourceExhausted, match=r"'a'.*hold 900 bytes.*this request's 400.*--max_queued_bytes"):
            handler.submit_batchable(executor, {"x": row}, ["y"], False, Ticket(model="a"))
        with pytest.raises(ResourceExhausted, match="this request's 308 would pass"):  # 900 of 1000 queued
            handler.submit(lambda: "ran", ticket=Ticket(model="c"), inputs={"s": strings})
        busy.release.set()
        done = await asyncio.gather(first, second)
        # with nothing queued, a request larger than the bound is taken (alone, the message size bounds it)
        alone = handler.submit(lambda: "alone", ticket=Ticket(model="a"), inputs={"t": np.zeros(5000, np.uint8)})
        return done, await alone

    try:
        done, alone = run(main())
    finally:
        handler.close()
    assert done[0][0].tolist() == (row * 2).tolist() and done[1] == "ran" and alone == "alone"
    assert handler._queued_bytes == 0


@pytest.mark.parametrize("multiprocess", [False, True])
def test_the_queue_depth_gauge_counts_the_waiting_runs(multiprocess, monkeypatch, tmp_path):
    if multiprocess:  # --serving_processes: every change is written (here, to this process's gauge value)
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    model = f"depth-{multiprocess}"
    handler = RunHandler(1)
    depth = lambda: REGISTRY.get_sample_value("servex_queue_depth", {"model": model})  # noqa: E731

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        queued = [handler.submit(lambda: 1, ticket=Ticket(model=model, labels=(model, "1", "s"))) for _ in range(3)]
        seen = [depth()]
        busy.release.set()
        await asyncio.gather(*queued)
        return seen + [depth()]

    try:
        assert run(main()) == [3, 0]
    finally:
        handler.close()


def test_batches_split_exactly_per_caller():
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8))
    executor = Doubler()
    values = [np.full((rows, 3), i, np.float32) for i, rows in enumerate([1, 2, 1, 3])]
    try:
        results = batched(handler, executor, values)
    finally:
        handler.close()
    assert executor.runs == [7]  # one run of all 7 rows
    for value, result in zip(values, results, strict=True):
        np.testing.assert_array_equal(result[0], value * 2)


def test_batches_pad_up_to_an_allowed_size_and_respect_the_maximum():
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=4, allowed_batch_sizes=(2, 4)))
    executor = Doubler()
    values = [np.full((1, 2), i, np.float32) for i in range(5)]
    try:
        results = batched(handler, executor, values)
    finally:
        handler.close()
    assert executor.runs == [4, 2]  # 4 rows, then 1 row padded to 2
    for value, result in zip(values, results, strict=True):
        np.testing.assert_array_equal(result[0], value * 2)
        assert result[0].shape == (1, 2)


def test_batches_form_per_priority_and_per_shape():
    handler = RunHandler(1, aging_seconds=0, batching=BatchingOptions(max_batch_size=8))
    executor = Doubler()
    values = [np.ones((1, 2), np.float32), np.ones((1, 2), np.float32), np.ones((1, 3), np.float32),
              np.ones((1, 2), np.float32)]  # fmt: skip
    try:
        results = batched(handler, executor, values, priorities=[0, 9, 0, 0])
    finally:
        handler.close()
    assert executor.runs == [1, 2, 1]  # the high one alone first; then the two [*,2] of priority 0; then [*,3]
    for value, result in zip(values, results, strict=True):
        np.testing.assert_array_equal(result[0], value * 2)


def test_outputs_without_a_batch_dimension_run_each_request_alone():
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8))
    executor = Doubler(scalar_output=True)
    values = [np.full((1, 2), i, np.float32) for i in range(3)]
    try:
        results = batched(handler, executor, values)
    finally:
        handler.close()
    assert [float(r[0]) for r in results] == [0.0, 2.0, 4.0]
    assert executor.runs == [3, 1, 1, 1]  # the batch of 3, then each request on its own


def test_a_graph_without_a_batch_dimension_is_remembered_and_runs_each_request_once():
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8))
    executor = Doubler(scalar_output=True)
    try:
        batched(handler, executor, [np.ones((1, 2), np.float32)] * 2)  # learns: no batch dimension
        executor.runs.clear()
        results = batched(handler, executor, [np.full((1, 2), i, np.float32) for i in range(3)])
    finally:
        handler.close()
    assert [float(r[0]) for r in results] == [0.0, 2.0, 4.0]
    assert executor.runs == [1, 1, 1]


class Counting:
    """A real GraphExecutor whose runs are counted (rows per run), to see how requests were batched."""

    def __init__(self, executor):
        self.executor = executor
        self.runs: list[int] = []

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        self.runs.append(next(iter(feeds.values())).shape[0])
        return self.executor.run(feeds, fetches, targets, graph_name, pin)


def test_a_request_of_zero_rows_runs_alone_and_leaves_batching_on(testdata):
    # With allowed batch sizes, a 0-row request used to be padded from its empty self: the batch came back short
    # of the padded size and the graph was marked unbatchable, for every client, until restart.
    model = load_saved_model(str(HALF_PLUS_TWO_TF1 / "00000123"))
    executor = Counting(GraphExecutor(model))
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8, allowed_batch_sizes=(2, 4, 8)))

    async def one(x):
        return await handler.submit_batchable(executor, {"x:0": x}, ["y:0"], False, Ticket())

    try:
        (empty,) = run(one(np.zeros((0, 1), np.float32)))
        assert executor.runs == [0]  # alone, unpadded
        values = [np.full((1, 1), i, np.float32) for i in range(6)]
        results = _batched_by_name(handler, executor, values)
        executor.runs.clear()
        results_again = _batched_by_name(handler, executor, values)
    finally:
        handler.close()
        executor.executor.close()
    assert empty.shape == (0, 1) and empty.dtype == np.float32
    for value, (y,), (y_again,) in zip(values, results, results_again, strict=True):
        np.testing.assert_array_equal(y, 0.5 * value + 2)
        np.testing.assert_array_equal(y_again, 0.5 * value + 2)
    assert len(executor.runs) < len(values), executor.runs  # still batched: 6 rows padded to 8, in one run
    assert executor.runs == [8]


def _batched_by_name(handler, executor, values):
    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        futures = [handler.submit_batchable(executor, {"x:0": v}, ["y:0"], False, Ticket()) for v in values]
        busy.release.set()
        await busy.future
        return await asyncio.gather(*futures)

    return run(main())


def test_a_lone_request_runs_once_even_when_its_output_has_no_batch_dimension():
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8))
    executor = Doubler(scalar_output=True)

    async def main():
        return await handler.submit_batchable(executor, {"x": np.ones((2, 2), np.float32)}, ["y"], False, Ticket())

    try:
        assert float(run(main())[0]) == 4.0
    finally:
        handler.close()
    assert executor.runs == [2]


class Done:
    """Counts a ticket's done callbacks."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


def test_done_is_called_once_whatever_becomes_of_the_request():
    handler = RunHandler(1, max_queued_per_model=3)
    dones = {name: Done() for name in ("ran", "failed", "cancelled", "expired", "refused")}

    def fail():
        raise ValueError("bad input")

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        ran = handler.submit(lambda: 1, ticket=Ticket(model="m", done=dones["ran"]))
        failed = handler.submit(fail, ticket=Ticket(model="m", done=dones["failed"]))
        cancelled = handler.submit(lambda: 1, ticket=Ticket(model="m", done=dones["cancelled"]))
        cancelled.cancel()
        # At the bound (3), the cancelled request is purged to make room for "expired"; "refused" finds it full.
        with pytest.raises(ResourceExhausted):
            handler.submit(lambda: 1, ticket=Ticket(model="m", deadline=time.monotonic() + 0.3,
                                                    done=dones["expired"]))  # fmt: skip
            handler.submit(lambda: 1, ticket=Ticket(model="m", done=dones["refused"]))
        await asyncio.sleep(0.5)
        busy.release.set()
        await busy.future
        assert await ran == 1
        with pytest.raises(ValueError):
            await failed

    try:
        run(main())
    finally:
        handler.close()
    assert {name: d.calls for name, d in dones.items()} == {
        "ran": 1, "failed": 1, "cancelled": 1, "expired": 1, "refused": 1
    }  # fmt: skip


def test_done_of_a_cancelled_caller_waits_for_its_running_run():
    handler = RunHandler(1)
    done = Done()

    async def main():
        busy_started, finish = threading.Event(), threading.Event()

        def slow():
            busy_started.set()
            assert finish.wait(10)

        future = handler.submit(slow, ticket=Ticket(done=done))
        await asyncio.get_running_loop().run_in_executor(None, busy_started.wait, 10)
        future.cancel()  # the caller went away while its run runs
        await asyncio.sleep(0.05)
        calls_while_running = done.calls
        finish.set()
        for _ in range(100):
            if done.calls:
                break
            await asyncio.sleep(0.01)
        return calls_while_running

    try:
        assert run(main()) == 0
    finally:
        handler.close()
    assert done.calls == 1


def test_cancelled_and_expired_requests_do_not_count_against_the_queue_bound():
    handler = RunHandler(1, max_queued_per_model=2)

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        gone = handler.submit(lambda: "gone", ticket=Ticket(model="m"))
        late = handler.submit(lambda: "late", ticket=Ticket(model="m", deadline=time.monotonic() + 0.01))
        gone.cancel()
        await asyncio.sleep(0.05)
        kept = [handler.submit(lambda: "kept", ticket=Ticket(model="m")) for _ in range(2)]
        busy.release.set()
        await busy.future
        with pytest.raises(DeadlineExceeded):
            await late
        return await asyncio.gather(*kept)

    try:
        assert run(main()) == ["kept", "kept"]
    finally:
        handler.close()


def test_priority_levels_are_forgotten_once_empty():
    handler = RunHandler(1)

    async def main():
        await asyncio.gather(*(handler.submit(lambda: 1, ticket=Ticket(priority=p)) for p in range(50)))

    try:
        run(main())
        assert handler._levels == {}
    finally:
        handler.close()


class SmallBatches(Doubler):
    """A model version with its own batching parameters (TensorFlow Serving's per-model batching_params.pbtxt)."""

    batching = BatchingOptions(max_batch_size=2)


def test_a_model_s_own_batching_parameters_replace_the_server_s():
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8))
    executor = SmallBatches()
    values = [np.full((1, 2), i, np.float32) for i in range(5)]
    try:
        results = batched(handler, executor, values)
    finally:
        handler.close()
    assert executor.runs == [2, 2, 1]  # the model's max_batch_size 2, not the server's 8
    for value, result in zip(values, results, strict=True):
        np.testing.assert_array_equal(result[0], value * 2)


def test_a_model_s_own_batching_turns_batching_on_for_it_alone():
    """A Triton config.pbtxt's dynamic_batching (TensorFlow Serving's per-model file is read only with the server's
    batching on: tests/server/test_app.py)."""
    handler = RunHandler(1)  # batching off for the server
    own, other = SmallBatches(), Doubler()
    try:
        batched(handler, own, [np.ones((1, 2), np.float32)] * 5)
        batched(handler, other, [np.ones((1, 2), np.float32)] * 3)
    finally:
        handler.close()
    assert own.runs == [2, 2, 1]
    assert other.runs == [1, 1, 1]
