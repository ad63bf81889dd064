"""What the RunHandler queues: a request's ticket (priority, deadline, labels), the queued item, and what is
learned of each client graph's cost (automatic batching)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from servex.executor.answers import Outbox
from servex.executor.batching import string_bytes
from servex.executor.cost_model import GraphCost
from servex.executor.graph_executor import client_graph_key, last_transfer
from servex.loader.errors import ServingError


class DeadlineExceeded(ServingError):
    code = "DEADLINE_EXCEEDED"


class Ticket(NamedTuple):
    """What the scheduler needs to know of one request besides its work (a tuple: one is made per request)."""

    priority: int = 0
    deadline: float | None = None  # time.monotonic() by which it must have started
    model: str = ""
    labels: tuple[str, str, str] = ("", "", "")  # model, version, signature or graph name
    # Called once when the request leaves the scheduler: after its run, or when it is dropped, expired or refused.
    # The core releases the version's lease here, so a cancelled caller never unloads a version under a run.
    done: Callable[[], None] | None = None
    # A traced request's RequestTrace (server/observability/tracing.py): the run handler adds its queue, batch and
    # run spans to it (``add(name, start, end, attributes, link)``, ``batch(start, end, size, requests)``).
    trace: object = None


DEFAULT_TICKET = Ticket()


def input_bytes(arrays) -> int:
    """What input arrays hold, for ``max_queued_bytes``: their buffers, and a string tensor's strings too."""
    return sum([array.nbytes + string_bytes(array) for array in arrays])


class WorkItem:
    """One queued request: its work, where its answer goes, and (batchable runs) the GraphExecutor-like object,
    feeds by tensor name and row count, grouped by ``batch_key``."""

    __slots__ = (
        "outbox", "future", "fn", "args", "ticket", "seq", "enqueued", "batch_key", "feeds", "rows", "nbytes", "cost"
    )  # fmt: skip

    def __init__(
        self, outbox, future, fn, args, ticket, seq, enqueued, batch_key=None, feeds=None, rows=0, nbytes=0, cost=None
    ):
        self.outbox: Outbox = outbox
        self.future: asyncio.Future = future
        self.fn: Callable = fn
        self.args: tuple = args
        self.ticket: Ticket = ticket
        self.seq: int = seq
        self.enqueued: float = enqueued
        self.batch_key: tuple | None = batch_key
        self.feeds: dict = feeds if feeds is not None else {}
        self.rows: int = rows
        self.nbytes: int = nbytes  # its input tensors' bytes, counted against max_queued_bytes
        self.cost: GraphCost | None = cost  # automatic batching: what is learned of its client graph


class GraphCosts:
    """One executor's GraphCosts by (feeds, fetches, pin), and the gauge labels they were shown under."""

    __slots__ = ("graphs", "labels")

    def __init__(self):
        self.graphs: dict[tuple, GraphCost] = {}
        self.labels: set[tuple[str, str, str]] = set()


def trace_run(item: WorkItem, started: float, ended: float, size: int = 1, requests: int = 1, link=None) -> None:
    """A traced request's ``queue`` and ``run`` spans (and ``batch``, linked to the batch's span, when it ran with
    others): the run's client graph key and graph name, and whether the graph was built for it or found."""
    trace = item.ticket.trace
    size, requests = int(size), int(requests)  # plain ints: OTLP's encoder refuses numpy's
    trace.add("queue", item.enqueued, started)
    if link is not None or requests > 1:
        trace.add("batch", started, ended, {"servex.batch.size": size, "servex.batch.requests": requests}, link)
    if item.batch_key is not None:  # (executor, fetches, pin, batching)
        feeds, fetches, targets, graph_name = item.feeds, item.args[1], (), ""
    elif len(item.args) >= 4 and isinstance(item.args[0], dict):  # executor.run(feeds, fetches, targets, name, ...)
        feeds, fetches, targets, graph_name = item.args[:4]
    else:
        feeds, fetches, targets, graph_name = (), (), (), ""
    transfer = last_transfer()  # this worker thread's run's
    if transfer is not None and started <= transfer[0] <= ended:
        trace.add("transfer", *transfer)
    build = next((span for span in trace.spans if span[0] == "build"), None)
    restored = (build[3] or {}).get("servex.variables.restored", 0) if build is not None else 0
    attributes = {"servex.client_graph": client_graph_key(tuple(feeds), fetches, targets),
                  "servex.graph_name": graph_name, "servex.client_graph.cache": "hit" if build is None else "build",
                  "servex.variables.restored": restored, "servex.batch.size": size}  # fmt: skip
    trace.add("run", started, ended, attributes)


def trace_batch(batch: list[WorkItem], started: float, ended: float, size: int) -> None:
    """The spans of a batch's traced requests: the batch's own span once, linked from each."""
    traced = [item for item in batch if item.ticket.trace is not None]
    if not traced:
        return
    link = traced[0].ticket.trace.batch(started, ended, int(size), len(batch))
    for item in traced:
        trace_run(item, started, ended, size, len(batch), link)


def saturated(item: WorkItem) -> bool:
    """Whether ``item``'s client graph already runs as many times at once as the scheduler lets it."""
    cost = item.cost
    return cost is not None and cost.running >= cost.concurrency
