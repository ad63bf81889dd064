"""How the RunHandler's worker runs a batch: the queued requests of one client graph merged into one run (padded
up to an allowed batch size), each caller handed its own rows; automatic batching's first-batch check; and each
request run on its own where the batch cannot be (a graph that mixes rows or refuses the batch, a bad input).
A mixin of RunHandler (executor/run_handler.py): it uses the handler's lock, metrics and cost model.

- **Batching** (``submit_batchable``): a free worker takes the highest-priority request and, from the same
  priority, every queued request of the same client graph whose inputs agree on all but the 0th dimension, up to
  ``max_batch_size`` rows; they run as one (padded up to the next allowed batch size) and each caller gets
  exactly its own rows back. A free worker never waits for a batch to fill: batching costs nothing at low load,
  and under load batches form from what queues while the workers are busy. A request of 0 rows runs alone.
  With ``pad_variable_length_inputs`` (TensorFlow Serving's), inputs of the same rank that differ in other
  dimensions batch too: each is padded at the end of every dimension but the 0th to the batch's largest size, with
  its own first element, as TensorFlow Serving pads; outputs come back at the padded size.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from servex.executor.answers import Held
from servex.executor.batching import BatchingOptions, PaddedBatch, batch_rows, pad_to_common_shape, program_rows
from servex.executor.client_graph import ran_compiled_graph, ran_on_one_thread
from servex.executor.cost_model import VERIFY_REQUESTS, answers_agree
from servex.executor.work import WorkItem, trace_batch, trace_run
from servex.loader.errors import ServingError

log = logging.getLogger("servex.executor.run_handler")


class BatchRuns:
    def _fill_batch(self, batch: list[WorkItem], queue, paced: bool, now: float) -> None:
        """Add to ``batch`` (its first request taken) the queued requests of the same client graph that fit: within
        its batch limit, the pacing credit, and padding's byte bound. The lock is held."""
        item = batch[0]
        outbox = item.outbox
        rows = item.rows
        most = outbox.credit if paced else math.inf  # requests in the batch
        batching = item.args[3]
        limit = item.cost.batch_limit() if item.cost is not None else batching.max_batch_size
        if item.cost is not None and rows < limit and item.cost.in_lanes():  # its lane's share (cost_model.py)
            queued = rows + sum(other.rows for other in queue if other.batch_key == item.batch_key)
            limit = min(limit, item.cost.lane_share(queued))
        bounded = batching.pad_variable_length_inputs and self.max_padded_batch_bytes
        padded = PaddedBatch.of(item) if bounded else None  # padding's byte bound: what the batch holds
        left = 0  # rows of the graph's requests left queued
        for other in list(queue):
            if other.batch_key != item.batch_key:
                continue
            if len(batch) >= most or rows + other.rows > limit or paced and other.outbox is not outbox:
                left += other.rows  # (paced: credit is the loop's own)
            else:
                expired = other.ticket.deadline is not None and now > other.ticket.deadline
                if other.future.cancelled() or expired:
                    queue.remove(other)
                    self._dequeued(other)
                    self._drop(other, now, expired)
                    continue
                if padded is not None:
                    joined = padded.joined(other)
                    if self._over_padded_bytes(joined, batching, item.feeds):
                        continue  # it waits for a later batch
                    padded = joined
                queue.remove(other)
                self._dequeued(other)
                batch.append(other)
                rows += other.rows
        if item.cost is not None:
            item.cost.waiting = rows + left  # the load on the graph, for its runs at once (runs_at_once.py)
            item.cost.load = rows + left + item.cost.running_rows  # and with its other runs' (cost_model.py)
            item.cost.running_rows += rows  # until its run is over (RunHandler._work)

    def _over_padded_bytes(self, padded: PaddedBatch, batching: BatchingOptions, feeds: dict) -> bool:
        """Whether a batch padded as ``padded`` says (inputs like ``feeds``) would hold more than
        ``max_padded_batch_bytes`` (set) where padding makes it larger than its inputs are: padding one long input's
        length onto short ones must not make a batch no single request could be. A batch that needs no padding is
        bounded as without pad_variable_length_inputs: not at all."""
        if not padded.padded:
            return False
        return padded.nbytes(feeds, batch_rows(batching, padded.rows)) > self.max_padded_batch_bytes

    def _run_batch(self, batch: list[WorkItem], started: float, held: Held) -> None:
        first = batch[0]
        executor, fetches, pin, batching = first.args
        rows = [item.rows for item in batch]
        total = sum(rows)
        size = batch_rows(batching, total)
        cost = first.cost
        if cost is not None and cost.compiled and cost.verified and len(batch) > 1 and size == total:
            size = program_rows(total, batching.max_batch_size)  # XLA's programs are compiled per batch size
        unbatched = first.batch_key in self._unbatchable or (cost is not None and cost.verified is False)
        if len(batch) == 1 and size == total or unbatched:  # nothing to merge, pad or split: each its own run
            for i, item in enumerate(batch):
                self._run_alone(item, executor, fetches, pin, time.monotonic() if i else started, held)
            return
        try:
            feeds = {}
            for name in first.feeds:
                parts = [item.feeds[name] for item in batch]  # each has rows: zero-row requests never batch
                if batching.pad_variable_length_inputs:
                    parts = pad_to_common_shape(parts)
                if size > total:  # pad with copies of the last row, as TensorFlow Serving pads
                    parts.append(np.repeat(parts[-1][-1:], size - total, axis=0))
                feeds[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            before, waiting, load = (cost.running, cost.waiting, cost.load) if cost is not None else (1, total, 0)
            alone = goes_alone(before, waiting, total, len(batch))
            outputs = executor.run(feeds, fetches, (), "", pin, alone=alone)
            seconds = time.monotonic() - started
            if any(o.ndim == 0 or o.shape[0] != size for o in outputs):
                self._unbatchable.add(first.batch_key)  # later requests of this graph run on their own
                raise _NotBatchable()
            if cost is not None and cost.verified is None:
                self._verify(batch, outputs, executor, fetches, pin)
        except BaseException as e:
            # Outputs without the batch dimension, one caller's bad input that must not fail the others, or no
            # memory for the merged inputs (the worker must live on, or every queued caller would wait forever):
            # run each on its own.
            alone = [self._run_alone(item, executor, fetches, pin, time.monotonic(), held) for item in batch]
            if cost is not None and isinstance(e, ServingError) and all(alone):
                # Every request runs alone, and TensorFlow refused them merged (a graph with a fixed batch size):
                # automatic batching leaves this graph.
                log.info("client graph %s runs unbatched: it refused a batch its requests run alone in (%s)",
                         cost.name, e)  # fmt: skip
                cost.verified = False
            return
        if cost is not None:
            cost.observe(
                total,
                seconds,
                at_once(before, cost),
                waiting,
                one_thread=ran_on_one_thread(),
                compiled=ran_compiled_graph(),
                load=load,
            )
        trace_batch(batch, started, started + seconds, size)
        self._metrics_for(first.ticket).stats.ran(len(batch), total, seconds)  # one graph: one model version
        offset = 0
        for item, n in zip(batch, rows, strict=True):
            metrics = self._metrics_for(item.ticket)
            metrics.run_seconds.observe(seconds)
            metrics.batch_size.observe(len(batch))
            held.add(item.outbox, item.future, True, [o[offset : offset + n] for o in outputs])
            self._finished(item)
            offset += n

    def _verify(self, batch: list[WorkItem], outputs: list[np.ndarray], executor, fetches, pin) -> None:
        """Automatic batching's check, on a client graph's first batch: its first requests run alone too, and must
        get the rows the batch gave them (within rounding); else the graph mixes rows (a softmax or mean over the
        batch, a random op) and never batches again: _NotBatchable."""
        cost = batch[0].cost
        offset = 0
        for item in batch[:VERIFY_REQUESTS]:
            started, before = time.monotonic(), cost.running
            single = executor.run(item.feeds, fetches, (), "", pin, alone=False)
            cost.observe(item.rows, time.monotonic() - started, at_once(before, cost))
            if not answers_agree([o[offset : offset + item.rows] for o in outputs], single):
                log.warning(
                    "client graph %s runs unbatched: batched, its answers differ from the same requests run one by "
                    "one (its rows depend on each other, or it is not deterministic)", cost.name
                )  # fmt: skip
                cost.verified = False
                raise _NotBatchable()
            offset += item.rows
        cost.verified = True

    def _run_alone(self, item: WorkItem, executor, fetches, pin, started: float, held: Held) -> bool:
        """Run ``item`` on its own and hand its answer back; whether it ran without an error."""
        cost = item.cost
        before, waiting, load = (cost.running, cost.waiting, cost.load) if cost is not None else (1, item.rows, 0)
        alone = goes_alone(before, waiting, item.rows)
        try:
            result, ok = executor.run(item.feeds, fetches, (), "", pin, alone=alone), True
        except BaseException as e:
            result, ok = e, False
        ended = time.monotonic()
        seconds = ended - started
        if ok and cost is not None:
            cost.observe(
                item.rows,
                seconds,
                at_once(before, cost),
                waiting,
                one_thread=ran_on_one_thread(),
                compiled=ran_compiled_graph(),
                load=load,
            )
        if item.ticket.trace is not None:
            trace_run(item, started, ended, item.rows)
        metrics = self._metrics_for(item.ticket)
        metrics.run_seconds.observe(seconds)
        metrics.stats.ran(1, item.rows, seconds)
        metrics.batch_size.observe(1)
        held.add(item.outbox, item.future, ok, result)
        self._finished(item)
        return ok


def at_once(before: int, cost) -> float:
    """The runs of ``cost``'s graph going at once during a run (this one included): the mean of the counts at its
    start and end (read without the lock: one int). Runs of a graph share the cores, so the cost model divides a
    run's time by it."""
    return (before + cost.running) / 2


def goes_alone(before: int, waiting: int, rows: int, requests: int = 1) -> bool:
    """Whether a run of ``rows`` rows goes alone: one request (``requests``), no other run of its graph going when
    it started (``before``, this one included) and no rows of it left queued (``waiting``, its own included). Only
    such runs may go to TensorFlow's inter-op pool (client_graph.py). A batch of several requests is several
    callers' (a load), even where it took every queued row: at 32 callers one run at a time, the GRU's batches on
    the inter-op pool (where its lone runs were found faster) served 1,166-1,493 rows/s against 1,468-1,732 on its
    worker."""
    return requests == 1 and before <= 1 and waiting <= rows


class _NotBatchable(Exception):
    pass
