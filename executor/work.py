"""What the RunHandler queues: a request's ticket (priority, deadline, labels), the queued item, and what is
learned of each client graph's cost (automatic batching)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from servex.executor.answers import Outbox
from servex.executor.batching import string_bytes
from servex.executor.cost_model import GraphCost
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


def saturated(item: WorkItem) -> bool:
    """Whether ``item``'s client graph already runs as many times at once as the scheduler lets it."""
    cost = item.cost
    return cost is not None and cost.running >= cost.choice.concurrency
