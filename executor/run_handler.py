"""RunHandler: the one scheduler every run goes through, so that TensorFlow never runs on the event loop.

Callers on an asyncio loop ``await handler.submit(fn, *args, ticket=...)``; a worker thread runs ``fn`` and
hands the result (or exception) back to the caller's loop.

Scheduling (the ticket says priority, deadline, model and metric labels):
- **Priority**: an integer, larger first, default 0 (TensorFlow's convention). Equal priorities keep arrival
  order. Waiting work ages: its effective priority grows by one every ``aging_seconds``, so a request of
  priority p waiting behind a steady stream of priority q > p runs after at most (q - p) * aging_seconds plus
  one run (plus, while paced, the loop's catch-up: paced work without credit lets unpaced work go first).
- **Deadlines**: a request whose deadline passed while queued is answered DEADLINE_EXCEEDED and never runs; one
  whose deadline had passed before it was submitted (spent receiving and decoding it) is answered so at once,
  never queued; a cancelled one (its caller went away) is dropped.
- **Bound**: at most ``max_queued_per_model`` requests of one model wait; beyond it, RESOURCE_EXHAUSTED at once.
  With ``max_queued_bytes``, the input tensors of all queued requests (every model) hold at most that many bytes:
  a request that would pass it is answered RESOURCE_EXHAUSTED at once, unless nothing is queued (a request alone
  is bounded by the message size).
- **Batching** (``submit_batchable``): see executor/batch_runs.py.
- **Pacing** (``lower_priority_burst``): see executor/pacing.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from servex.executor import work
from servex.executor.answers import Held, Outbox
from servex.executor.batch_runs import BatchRuns
from servex.executor.batching import BatchingOptions
from servex.executor.cost_model import COMPUTE_BOUND_RUNS, GraphCost
from servex.executor.metrics import RunMetrics, forget_choices, show_choice
from servex.executor.pacing import Pacing
from servex.executor.work import DEFAULT_TICKET, DeadlineExceeded, GraphCosts, Ticket, WorkItem, input_bytes, saturated
from servex.loader.errors import ResourceExhausted

__all__ = ["BatchingOptions", "DeadlineExceeded", "RunHandler", "Ticket", "input_bytes"]

log = logging.getLogger(__name__)

MIXED_PRIORITY_SECONDS = 1.0  # see Held (executor/answers.py) and the RunHandler's pacing


class RunHandler(BatchRuns, Pacing):
    def __init__(
        self,
        num_workers: int,
        *,
        max_queued_per_model: int = 0,
        max_queued_bytes: int = 0,
        aging_seconds: float = 0.1,
        batching: BatchingOptions | None = None,
        hold_seconds: float = 0.001,
        lower_priority_burst: int = 0,
        pace_timeout: float = 0.1,
        max_padded_batch_bytes: int = 0,
        intra_op_threads: int = 1,
        compute_bound_runs: int = COMPUTE_BOUND_RUNS,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.max_queued_per_model = max_queued_per_model
        self.max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0  # input bytes of every queued request (counted only with max_queued_bytes)
        self.aging_seconds = aging_seconds
        self.batching = batching
        # With pad_variable_length_inputs, a request joins a batch only while the batch's padded inputs stay within
        # this many bytes (0: no bound); the server passes its message size limit.
        self.max_padded_batch_bytes = max_padded_batch_bytes
        # Automatic batching: each executor's GraphCosts by (feeds, fetches, pin), gone with the executor (and their
        # gauges with them). ``intra_op_threads``: the intra-op threads of each version's session.
        self._costs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.intra_op_threads = intra_op_threads
        # Automatic batching runs a compute-bound graph ``compute_bound_runs`` times at once (cost_model.py), on
        # more threads than ``num_workers`` where need be, started once a graph is found compute-bound (an idle
        # worker would be woken by every submit in vain while a call-bound graph runs on the others); a call-bound
        # graph runs on at most ``num_workers``.
        self.num_workers = num_workers
        self.compute_bound_runs = compute_bound_runs
        self.hold_seconds = hold_seconds
        # Pacing (0: off): lower-priority requests started per catch-up of the event loop; a probe that has not
        # come back after pace_timeout seconds (a stalled loop) counts as back, so the queue never stops.
        self.lower_priority_burst = lower_priority_burst
        self.pace_timeout = pace_timeout
        # The highest priority that arrived, and until when it counts as arriving (a second after its last).
        self._top, self._top_until = 0, 0.0
        # Until then, requests of more than one priority have been arriving: answers are not held (see Held).
        self._mixed_until = 0.0
        self._last_priority = 0
        # The queue's lock (re-entrant), taken directly on the hot paths (``with self._mutex``: no Python-level
        # __enter__), and its condition; ``_waiting`` counts the workers waiting on it, so that a submit notifies
        # only when one does.
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._waiting = 0
        self._levels: dict[int, deque[WorkItem]] = {}
        self._queued: dict[str, int] = {}
        self._seq = itertools.count()
        self._stopping = False
        self._outboxes: dict[asyncio.AbstractEventLoop, Outbox] = {}
        self._metrics: dict[tuple, RunMetrics] = {}
        # Batch keys whose graphs answered without the batch dimension: their requests never batch again.
        self._unbatchable: set[tuple] = set()
        self._threads = [
            threading.Thread(target=self._work, name=f"servex-run-{i}", daemon=True) for i in range(num_workers)
        ]
        for t in self._threads:
            t.start()

    # -- submitting ------------------------------------------------------------------------------------

    def submit(
        self, fn: Callable, *args, ticket: Ticket = DEFAULT_TICKET, inputs: Mapping[str, np.ndarray] | None = None
    ) -> asyncio.Future:
        """Queue ``fn(*args)``; the returned future (on the running loop) completes with its result. ``inputs``:
        its input tensors, counted against ``max_queued_bytes`` while it waits."""
        nbytes = input_bytes(inputs.values()) if inputs and self.max_queued_bytes else 0
        return self._enqueue(fn, args, ticket, None, {}, 0, nbytes)

    def batching_for(self, executor) -> BatchingOptions | None:
        """How ``executor``'s runs batch: its own parameters when it has them (TensorFlow Serving's per-model
        batching_params.pbtxt, with the server's batching on; a Triton config.pbtxt's dynamic_batching), else the
        server's (None: off)."""
        return getattr(executor, "batching", None) or self.batching

    def submit_batchable(self, executor, feeds: dict, fetches: Sequence[str], pin: bool, ticket: Ticket):
        """Queue ``executor.run(feeds, fetches, (), "", pin)``, which may run batched with compatible requests."""
        fetches = tuple(fetches)
        batching = self.batching_for(executor)
        values = list(feeds.values())
        nbytes = input_bytes(values) if self.max_queued_bytes else 0
        rows = values[0].shape[0] if batching is not None and values and values[0].ndim else 0
        # No rows (or scalars): nothing to batch, and nothing to pad with (its answer is its own, empty, run).
        if not 0 < rows <= batching.max_batch_size or any(v.ndim == 0 or v.shape[0] != rows for v in values):
            return self._enqueue(executor.run, (feeds, fetches, (), "", pin), ticket, None, {}, 0, nbytes)
        if batching.pad_variable_length_inputs:  # any size beyond the 0th dimension (an empty input has no padding)
            shapes = tuple([(v.dtype, v.ndim if v.size else v.shape[1:]) for v in values])
        else:
            shapes = tuple([(v.dtype, v.shape[1:]) for v in values])
        key = (id(executor), tuple(feeds), fetches, pin, shapes)
        if key in self._unbatchable:
            return self._enqueue(executor.run, (feeds, fetches, (), "", pin), ticket, None, {}, 0, nbytes)
        item_args = (executor, fetches, pin, batching)
        cost = self._cost_for(executor, key, batching, ticket) if batching.auto else None
        if cost is not None and cost.verified is False:  # it mixes rows: never batched (it keeps its choice)
            item_args, key = (feeds, fetches, (), "", pin), None
        return self._enqueue(executor.run, item_args, ticket, key, feeds, rows, nbytes, cost)

    def _cost_for(self, executor, key: tuple, batching: BatchingOptions, ticket: Ticket) -> GraphCost:
        """The GraphCost of ``executor``'s client graph that ``key`` (a batch key) runs, made on first use."""
        costs = self._costs.get(executor)
        if costs is None:
            costs = self._costs.setdefault(executor, GraphCosts())
            weakref.finalize(executor, forget_choices, costs.labels)  # the version unloaded: its gauges go
        graph = key[1:4]  # feeds, fetches, pin: one client graph whatever its inputs' shapes
        cost = costs.graphs.get(graph)
        if cost is None:
            model, version, signature = labels = ticket.labels
            name = f"{signature or ','.join(key[1])!r} of model {model!r} version {version}"
            costs.labels.add(labels)
            cost = GraphCost(
                batching.max_batch_size,
                self.num_workers,
                self.intra_op_threads,
                name,
                lambda choice: self._chosen(labels, choice),
                self.compute_bound_runs,
            )
            cost = costs.graphs.setdefault(graph, cost)
            show_choice(labels, cost.choice)
        return cost

    def _chosen(self, labels: tuple, choice) -> None:
        """A client graph's new choice: shown, and the workers it may run on started."""
        show_choice(labels, choice)
        with self._mutex:
            while len(self._threads) < choice.concurrency and not self._stopping:
                thread = threading.Thread(target=self._work, name=f"servex-run-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _enqueue(self, fn, args, ticket: Ticket, batch_key, feeds, rows: int, nbytes: int, cost=None) -> asyncio.Future:
        try:
            return self._enqueue_or_raise(fn, args, ticket, batch_key, feeds, rows, nbytes, cost)
        except BaseException:
            if ticket.done is not None:
                ticket.done()
            raise

    def _enqueue_or_raise(
        self, fn, args, ticket: Ticket, batch_key, feeds, rows: int, nbytes: int, cost
    ) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes.setdefault(loop, Outbox(loop))
        future = loop.create_future()
        metrics = self._metrics_for(ticket)
        late = time.monotonic() - ticket.deadline if ticket.deadline is not None else -1.0
        if late > 0:  # it went by while the call was received, decoded and prepared: never queued
            metrics.deadline_exceeded.inc()
            raise DeadlineExceeded(
                f"the deadline had passed {late:.3f}s before the request reached the run queue (the time went into "
                f"receiving, decoding and preparing it); the run did not happen"
            )
        with self._mutex:
            if self._stopping:
                raise RuntimeError("RunHandler is closed")
            queued = self._queued.get(ticket.model, 0)
            if self.max_queued_per_model and queued >= self.max_queued_per_model:
                queued = self._purge(ticket.model)
            if self.max_queued_per_model and queued >= self.max_queued_per_model:
                metrics.rejected()
                raise ResourceExhausted(
                    f"model {ticket.model!r}: {queued} requests are queued, the limit (--max_queued_requests); "
                    f"try again later"
                )
            if nbytes and self.max_queued_bytes:
                if self._queued_bytes and self._queued_bytes + nbytes > self.max_queued_bytes:
                    metrics.rejected()
                    raise ResourceExhausted(
                        f"model {ticket.model!r}: the queued requests' inputs hold {self._queued_bytes} bytes, and "
                        f"this request's {nbytes} would pass the limit of {self.max_queued_bytes} bytes "
                        f"(--max_queued_bytes); try again later"
                    )
                self._queued_bytes += nbytes
            now = time.monotonic()
            if ticket.priority >= self._top or now > self._top_until:
                self._top, self._top_until = ticket.priority, now + MIXED_PRIORITY_SECONDS
            if ticket.priority != self._last_priority:
                self._last_priority = ticket.priority
                self._mixed_until = now + MIXED_PRIORITY_SECONDS
            item = WorkItem(
                outbox, future, fn, args, ticket, next(self._seq), now, batch_key, feeds, rows, nbytes, cost
            )
            level = self._levels.get(ticket.priority)
            if level is None:
                level = self._levels[ticket.priority] = deque()
            level.append(item)
            self._queued[ticket.model] = queued + 1
            metrics.set_queue_depth(queued + 1)
            if self._waiting and not saturated(item):  # a worker woken for a graph at its runs at once would
                self._cond.notify()  # find nothing to take: the worker whose run ends takes it (_work)
        return future

    def _purge(self, model: str) -> int:
        """Drop ``model``'s queued requests whose callers went away or whose deadline passed, so that they do not
        count against the bound; returns how many remain queued. The lock is held; runs only at the bound."""
        now = time.monotonic()
        for priority, queue in list(self._levels.items()):
            for item in [i for i in queue if i.ticket.model == model]:
                expired = item.ticket.deadline is not None and now > item.ticket.deadline
                if item.future.cancelled() or expired:
                    queue.remove(item)
                    self._dequeued(item)
                    self._drop(item, now, expired)
            if not queue:
                del self._levels[priority]
        return self._queued.get(model, 0)

    def _metrics_for(self, ticket: Ticket) -> RunMetrics:
        key = (*ticket.labels, ticket.priority)
        metrics = self._metrics.get(key)
        if metrics is None:
            metrics = self._metrics.setdefault(key, RunMetrics(*ticket.labels, str(ticket.priority), self._queued))
        return metrics

    # -- the workers -----------------------------------------------------------------------------------

    def _take(self, wait: bool = True) -> list[WorkItem] | None:
        """The next work (one item, or a batch); None when stopping, or when nothing waits and ``wait`` is false.
        The lock is held."""
        while True:
            while not any(self._levels.values()):
                if self._stopping or not wait:
                    return None
                self._wait()
            now = time.monotonic()
            levels = [p for p, q in self._levels.items() if q]
            level = max(levels, key=self._score(now))
            if self._dropped_head(level, now):
                continue
            queue = self._levels[level]
            item = queue[0]
            if saturated(item):  # its client graph runs as many times at once as it may: other work goes first
                found = self._first_runnable(levels, now)
                if found is None:
                    if not wait:
                        return None
                    self._wait()
                    continue
                level, item = found
                queue = self._levels[level]
            outbox = item.outbox
            paced = self._paced(level, now)
            if paced and outbox.credit <= 0:
                # Aged lower-priority work may outscore a higher priority; it must not hold that up while it
                # waits for the loop: the best level that is not paced goes first.
                unpaced = [p for p in levels if not self._paced(p, now)]
                if unpaced:
                    level, paced = max(unpaced, key=self._score(now)), False
                    if self._dropped_head(level, now):
                        continue
                    queue = self._levels[level]
                    item = queue[0]
                    outbox = item.outbox
                elif not wait:  # hand the held answers back first: the probe must go behind them
                    return None
                else:
                    self._catch_up(outbox, now)
                    continue
            if queue[0] is item:
                queue.popleft()
            else:
                queue.remove(item)
            self._dequeued(item)
            batch = [item]
            if item.cost is not None:
                item.cost.running += 1  # until its run is over (_work)
            if item.batch_key is not None:
                self._fill_batch(batch, queue, paced, now)
            if not queue:
                del self._levels[level]
            if paced:
                outbox.credit -= len(batch)
                outbox.probe_due = outbox.credit <= 0  # the worker sends it once the batch's answers are back
            return batch

    def _first_runnable(self, levels: list[int], now: float) -> tuple[int, WorkItem] | None:
        """The first queued request, levels in score order, whose client graph may run once more now (the lock is
        held): what a worker takes while the best level's first request waits for a run of its graph to end."""
        for level in sorted(levels, key=self._score(now), reverse=True):
            for item in self._levels[level]:
                if not saturated(item):
                    return level, item
        return None

    def _dropped_head(self, level: int, now: float) -> bool:
        """Drop the first request of ``level`` if its caller went away or its deadline passed (gRPC cancels at the
        deadline); whether it did. The lock is held."""
        queue = self._levels[level]
        item = queue[0]
        expired = item.ticket.deadline is not None and now > item.ticket.deadline
        if not (item.future.cancelled() or expired):
            return False
        queue.popleft()
        self._dequeued(item)
        self._drop(item, now, expired)
        if not queue:
            del self._levels[level]
        return True

    def _score(self, now: float):
        """The key that orders levels: priority plus age (one per ``aging_seconds`` waited), then arrival."""
        if self.aging_seconds > 0:
            return lambda p: (p + (now - self._levels[p][0].enqueued) / self.aging_seconds, -self._levels[p][0].seq)
        return lambda p: (p, -self._levels[p][0].seq)

    def _drop(self, item: WorkItem, now: float, expired: bool) -> None:
        """A queued request that will not run: expired ones are answered DEADLINE_EXCEEDED."""
        if expired:
            self._metrics_for(item.ticket).deadline_exceeded.inc()
            if not item.future.cancelled():
                left = item.ticket.deadline - item.enqueued
                error = DeadlineExceeded(
                    f"the deadline passed while the request waited in the run queue: queued {now - item.enqueued:.3f}s "
                    f"with {left:.3f}s left when it was queued; the run did not happen"
                )
                item.outbox.put(item.future, False, error)
        self._finished(item)

    @staticmethod
    def _finished(item: WorkItem) -> None:
        if item.ticket.done is not None:
            try:
                item.ticket.done()
            except Exception:  # a failing callback must not take a worker down
                log.exception("a run's done callback failed")

    def _dequeued(self, item: WorkItem) -> None:
        self._queued_bytes -= item.nbytes
        left = self._queued[item.ticket.model] - 1
        self._queued[item.ticket.model] = left
        self._metrics_for(item.ticket).set_queue_depth(left)

    def _work(self) -> None:
        held = Held(self.hold_seconds)
        while True:
            with self._mutex:
                batch = self._take(wait=not held.results)
            if batch is None:  # stopping, or (holding results) nothing waits, or it waits for the loop
                if not held.results:
                    return
                held.hand_back()
                self._send_due_probes()
                continue
            started = time.monotonic()
            kind = self._metrics_for(batch[0].ticket)  # its model, version, signature and priority
            held.before(started, expected=kind.last_run)
            for item in batch:
                metrics = self._metrics_for(item.ticket)
                metrics.queue_wait.observe(started - item.enqueued)
                metrics.stats.waited(started - item.enqueued)
            if batch[0].batch_key is None:
                item = batch[0]
                try:
                    result, ok = item.fn(*item.args), True
                except BaseException as e:  # handed to the caller, which decides what it means
                    result, ok = e, False
                ended = time.monotonic()
                seconds = ended - started
                kind.run_seconds.observe(seconds)
                kind.stats.ran(1, 1, seconds)
                if item.ticket.trace is not None:
                    work.trace_run(item, started, ended)
                held.add(item.outbox, item.future, ok, result)
                self._finished(item)
            else:
                self._run_batch(batch, started, held)
            cost = batch[0].cost
            if cost is not None:
                with self._mutex:
                    cost.running -= 1
                    if batch[0].batch_key is not None:
                        cost.running_rows -= sum(item.rows for item in batch)
                    # The run it freed is this worker's to take, back in _take in a moment: a worker is woken only
                    # where the graph may run more at once beside it (its runs at once rose while its requests
                    # queued). A woken one would cost a thread switch and leave this one to wait: a GRU one run at a
                    # time on two workers served 1,445-1,499 rows/s at 32 callers against 1,546-1,594 on one.
                    if self._waiting and cost.running + 1 < cost.concurrency:
                        self._cond.notify()
            kind.last_run = time.monotonic() - started
            held.after(started, mixed=started < self._mixed_until)
            if not held.results:
                self._send_due_probes()

    def close(self) -> None:
        """Let queued work finish, then stop the workers; later submits raise RuntimeError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
