"""Per model version inference statistics, exact counts and nanoseconds as Triton reports them (its
``ModelStatistics``: tritonclient's ``get_inference_statistics``), beside the Prometheus histograms.

The RunHandler adds each request's queue wait (``waited``) and each run's time (``ran``); the server adds each
answered inference call's outcome and time end to end, with the time its adapter took to decode the request's
tensors and encode the answer's where it timed them (``answered``). Each update takes the version's lock
once. ``snapshot()`` copies the figures for an answer.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class Snapshot:
    last_inference_ms: int = 0  # since the epoch, 0: none yet
    inference_count: int = 0  # requests' rows run (a batch of N rows counts N)
    execution_count: int = 0  # runs (a batch of several requests counts 1)
    success: Duration = field(default_factory=Duration)  # answered OK, end to end in the server
    fail: Duration = field(default_factory=Duration)  # answered with an error after their version was resolved
    queue: Duration = field(default_factory=Duration)  # time waiting for a run worker
    compute_input: Duration = field(default_factory=Duration)  # decoding a successful request's tensors
    compute_infer: Duration = field(default_factory=Duration)  # per request: the run (of its batch) that served it
    compute_output: Duration = field(default_factory=Duration)  # encoding its answer's tensors
    batches: dict[int, Duration] = field(default_factory=dict)  # requests per run -> runs and their time


class ModelStatistics:
    def __init__(self):
        self._lock = threading.Lock()
        self._figures = Snapshot()

    def waited(self, seconds: float) -> None:
        """One request waited ``seconds`` for a run worker."""
        with self._lock:
            self._figures.queue.add(seconds)

    def ran(self, requests: int, rows: int, seconds: float) -> None:
        """One run of ``requests`` requests (``rows`` rows in all) that took ``seconds``."""
        with self._lock:
            f = self._figures
            f.last_inference_ms = int(time.time() * 1000)
            f.inference_count += rows
            f.execution_count += 1
            f.compute_infer.add(seconds * requests, requests)
            batch = f.batches.get(requests)
            if batch is None:
                batch = f.batches[requests] = Duration()
            batch.add(seconds)

    def answered(self, ok: bool, seconds: float, decoding: float = 0.0, encoding: float = 0.0) -> None:
        """One inference call answered (``ok``: successfully) after ``seconds`` in the server; of a successful
        one, ``decoding`` and ``encoding`` are its tensors' (0: not timed, not counted)."""
        with self._lock:
            f = self._figures
            if not ok:
                f.fail.add(seconds)
                return
            f.success.add(seconds)
            if decoding:
                f.compute_input.add(decoding)
            if encoding:
                f.compute_output.add(encoding)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return copy.deepcopy(self._figures)


_all: dict[tuple[str, str], ModelStatistics] = {}
_all_lock = threading.Lock()


def statistics(model: str, version: str) -> ModelStatistics:
    """The statistics of one model version (version as text, as in the metric labels); made on first use."""
    stats = _all.get((model, version))
    if stats is None:
        with _all_lock:
            stats = _all.setdefault((model, version), ModelStatistics())
    return stats


def every() -> list[tuple[str, str, ModelStatistics]]:
    """(model, version, statistics) of every model version counted so far, sorted."""
    with _all_lock:
        return [(model, version, stats) for (model, version), stats in sorted(_all.items())]
