"""What the RunHandler tells a traced request's trace (executor/work.py's trace_run and trace_batch): its queue
wait, its run (client graph key, cache hit), and, batched, one batch span per batch that each traced request
links to, with the batch's size."""

from __future__ import annotations

import asyncio

import numpy as np

from servex.executor.batching import BatchingOptions
from servex.executor.run_handler import RunHandler, Ticket
from servex.executor.work import WorkItem, trace_batch
from tests.executor.fakes import Busy, Doubler, run


class Recorder:
    """A trace as the run handler sees one (``add`` and ``batch``), keeping what it is told."""

    def __init__(self):
        self.spans: list[tuple] = []
        self.batches: list[tuple] = []

    def add(self, name, start, end, attributes=None, link=None):
        self.spans.append((name, start, end, attributes, link))

    def batch(self, start, end, size, requests):
        self.batches.append((start, end, size, requests))
        return f"batch-{len(self.batches)}"

    def named(self, name):
        return [s for s in self.spans if s[0] == name]


def test_a_batch_of_traced_and_untraced_requests_gives_one_batch_span_that_each_traced_one_links_to():
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8))
    executor = Doubler()
    traces = [Recorder(), None, Recorder()]

    async def main():
        busy = Busy(handler)
        await busy.wait_started()
        futures = [
            handler.submit_batchable(executor, {"x": np.ones((2, 3), np.float32)}, ["y"], False, Ticket(trace=t))
            for t in traces
        ]
        busy.release.set()
        await busy.future
        return await asyncio.gather(*futures)

    try:
        run(main())
    finally:
        handler.close()
    assert executor.runs == [6]
    first, _, last = traces
    assert first.batches == [first.batches[0]] and first.batches[0][2:] == (6, 3) and not last.batches
    for trace in (first, last):
        (queue,), (batch,), (ran,) = trace.named("queue"), trace.named("batch"), trace.named("run")
        assert queue[1] <= queue[2] == batch[1] == ran[1] <= ran[2]  # queued until the batch started
        assert batch[3] == {"servex.batch.size": 6, "servex.batch.requests": 3} and batch[4] == "batch-1"
        assert ran[3]["servex.client_graph"] == "x^y^" and ran[3]["servex.client_graph.cache"] == "hit"
        assert ran[3]["servex.variables.restored"] == 0


def test_a_request_run_alone_has_queue_and_run_spans_and_no_batch():
    handler = RunHandler(1)
    trace = Recorder()
    trace.add("build", 0.0, 0.0, {"servex.client_graph.cache": "build", "servex.variables.restored": 3})

    async def main():
        return await handler.submit(Doubler().run, {"x": np.ones((1, 2), np.float32)}, ["y"], (), "g",
                                    ticket=Ticket(trace=trace))  # fmt: skip

    try:
        run(main())
    finally:
        handler.close()
    assert [s[0] for s in trace.spans] == ["build", "queue", "run"] and not trace.batches
    attributes = trace.named("run")[0][3]
    assert attributes["servex.graph_name"] == "g" and attributes["servex.client_graph.cache"] == "build"
    assert attributes["servex.variables.restored"] == 3  # what its build span waited for


def test_a_batchs_sizes_reach_the_trace_as_plain_ints():
    """OTLP's encoder refuses numpy integers (an export of 512 spans would fail for one): sizes computed with numpy
    arrive as ints."""
    traces = [Recorder(), Recorder()]
    batch = [
        WorkItem(None, None, None, ({"x": 1}, ["y"]), Ticket(trace=t), i, 0.0, batch_key=("k",), rows=1)
        for i, t in enumerate(traces)
    ]
    trace_batch(batch, 1.0, 2.0, np.int64(4))
    (first_batch,) = traces[0].batches
    assert first_batch[2:] == (4, 2) and type(first_batch[2]) is int
    for trace in traces:
        (ran,) = trace.named("run")
        assert type(ran[3]["servex.batch.size"]) is int
        (batch_span,) = trace.named("batch")
        assert type(batch_span[3]["servex.batch.size"]) is int
