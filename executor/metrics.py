"""Client-graph cache metrics, labelled by model and version (prometheus_client, exported on /metrics)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from servex.executor.statistics import statistics
from servex.loader.variables import VariableHooks, VariableStore

LABELS = ["model", "version"]

CACHE_HITS = Counter("servex_client_graph_cache_hits", "Runs whose client graph was already built", LABELS)
CACHE_MISSES = Counter("servex_client_graph_cache_misses", "Runs whose client graph was not yet built", LABELS)
BUILDS = Counter("servex_client_graph_builds", "Client graphs built (pruned and made callable)", LABELS)
BUILD_SECONDS = Histogram(
    "servex_client_graph_build_seconds",
    "Time to build one client graph",
    LABELS,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
EVICTIONS = Counter("servex_client_graph_cache_evictions", "Client graphs evicted (least recently used)", LABELS)
ENTRIES = Gauge("servex_client_graph_cache_entries", "Client graphs in the cache", LABELS, multiprocess_mode="livesum")


class CacheMetrics:
    """The label children of one model version, looked up once."""

    def __init__(self, model: str, version: str):
        self.labels = (model, version)
        self.hits = CACHE_HITS.labels(model, version)
        self.misses = CACHE_MISSES.labels(model, version)
        self.builds = BUILDS.labels(model, version)
        self.build_seconds = BUILD_SECONDS.labels(model, version)
        self.evictions = EVICTIONS.labels(model, version)
        self.entries = ENTRIES.labels(model, version)

    def remove(self) -> None:
        """Drop this version's series (it was unloaded)."""
        for metric in (CACHE_HITS, CACHE_MISSES, BUILDS, BUILD_SECONDS, EVICTIONS, ENTRIES):
            try:
                metric.remove(*self.labels)
            except KeyError:
                pass


RESTORE_SECONDS = Histogram(
    "servex_variable_restore_seconds",
    "Time to read variables from the checkpoint, per restore (the variables one client graph or prefetch needs)",
    LABELS,
    buckets=(0.0001, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RESTORED_BYTES = Gauge(
    "servex_restored_variable_bytes",
    "Bytes of variables restored onto their device",
    LABELS,
    multiprocess_mode="livesum",
)
VARIABLES = Gauge(
    "servex_variables",
    "Variables by state (UNRESTORED, RESTORING, RESTORED, ON_DEVICE)",
    [*LABELS, "state"],
    multiprocess_mode="livesum",
)
ASSIGNMENTS = Counter("servex_variable_assignments", "Variables replaced through AssignVariable", LABELS)

STATES = ("UNRESTORED", "RESTORING", "RESTORED", "ON_DEVICE")


class VariableMetrics(VariableHooks):
    """Reports one model version's variable store to Prometheus."""

    def __init__(self, model: str, version: str):
        self.labels = (model, version)
        self.restore_seconds = RESTORE_SECONDS.labels(model, version)
        self.restored_bytes = RESTORED_BYTES.labels(model, version)
        self.assignments = ASSIGNMENTS.labels(model, version)
        self.states = {state: VARIABLES.labels(model, version, state) for state in STATES}

    def restored(self, entries, seconds: float) -> None:
        self.restore_seconds.observe(seconds)

    def changed(self, store: VariableStore) -> None:
        counts = dict.fromkeys(STATES, 0)
        on_device_bytes = 0
        for record, state in store.listing():
            counts[state] += 1
            if state == "ON_DEVICE":
                on_device_bytes += record.nbytes
        for state, gauge in self.states.items():
            gauge.set(counts[state])
        self.restored_bytes.set(on_device_bytes)

    def assigned(self, store: VariableStore) -> None:
        self.assignments.inc()

    def remove(self) -> None:
        for metric in (RESTORE_SECONDS, RESTORED_BYTES, ASSIGNMENTS):
            try:
                metric.remove(*self.labels)
            except KeyError:
                pass
        for state in STATES:
            try:
                VARIABLES.remove(*self.labels, state)
            except KeyError:
                pass


RUN_LABELS = ["model", "version", "signature", "priority"]
FINE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10,
)  # fmt: skip
QUEUE_WAIT = Histogram("servex_queue_wait_seconds", "Time a run waited in the RunHandler's queue", RUN_LABELS,
                       buckets=FINE_BUCKETS)  # fmt: skip
RUN_SECONDS = Histogram("servex_run_seconds", "Graph execution time of a run (of its batch, when batched)",
                        RUN_LABELS, buckets=FINE_BUCKETS)  # fmt: skip
BATCH_SIZE = Histogram("servex_batch_size", "Requests per executed batch, observed once per request", RUN_LABELS,
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))  # fmt: skip
QUEUE_DEPTH = Gauge(
    "servex_queue_depth", "Runs waiting in the RunHandler's queue, per model", ["model"], multiprocess_mode="livesum"
)
DEADLINE_EXCEEDED = Counter(
    "servex_deadline_exceeded", "Requests whose deadline passed before their run started (never run)", RUN_LABELS
)
REJECTED = Counter("servex_queue_rejected", "Requests refused because the model's queue was full", RUN_LABELS)


def _ignore(value: float) -> None:
    pass


def queue_depth_setter(model: str, depths: dict[str, int]) -> Callable[[float], None]:
    """What the RunHandler calls with ``model``'s queue depth on every change. Where each process keeps its own
    metrics, the gauge reads ``depths`` (the handler's count by model) when /metrics is scraped, and the calls do
    nothing: requests do not pay for it. In prometheus_client's multiprocess mode (--serving_processes) the
    supervisor reads the gauge from the processes' files, so each change is written there."""
    gauge = QUEUE_DEPTH.labels(model)
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return gauge.set
    gauge.set_function(lambda: depths.get(model, 0))
    return _ignore


class RunMetrics:
    """The RunHandler's label children for one (model, version, signature, priority); ``depths``: the handler's
    queued requests by model (see ``queue_depth_setter``)."""

    def __init__(self, model: str, version: str, signature: str, priority: str, depths: dict[str, int]):
        labels = (model, version, signature, priority)
        self.queue_wait = QUEUE_WAIT.labels(*labels)
        self.run_seconds = RUN_SECONDS.labels(*labels)
        self.batch_size = BATCH_SIZE.labels(*labels)
        self.set_queue_depth = queue_depth_setter(model, depths)
        self.deadline_exceeded = DEADLINE_EXCEEDED.labels(*labels)
        self.stats = statistics(model, version)  # Triton's per-version figures (executor/statistics.py)
        self.last_run = 0.0  # seconds the last run took: the RunHandler's guess of the next one's
        self._rejected = REJECTED.labels(*labels)

    def rejected(self) -> None:
        self._rejected.inc()


# Automatic batching's choices per client graph (executor/cost_model.py), labelled as the run metrics are but for
# the priority; the signature label is the graph name for runs by tensor names.
SCHEDULER_LABELS = ["model", "version", "signature"]
SCHEDULER_BATCH_LIMIT = Gauge(
    "servex_scheduler_batch_limit",
    "Rows the scheduler lets one batch of a client graph take (automatic batching)",
    SCHEDULER_LABELS,
    multiprocess_mode="livemax",
)
SCHEDULER_CONCURRENCY = Gauge(
    "servex_scheduler_concurrency",
    "Runs of a client graph the scheduler lets go at once (automatic batching)",
    SCHEDULER_LABELS,
    multiprocess_mode="livemax",
)
SCHEDULER_COMPUTE_BOUND = Gauge(
    "servex_scheduler_compute_bound",
    "1 where the scheduler found that a client graph's run, not the call, is the cost (automatic batching)",
    SCHEDULER_LABELS,
    multiprocess_mode="livemax",
)
SCHEDULER_THREADS = Gauge(
    "servex_scheduler_intra_op_threads",
    "TensorFlow intra-op threads a client graph's runs use (its version's session's: the cores servex may use, unless "
    "set; 1 where it runs in the version's one-thread session)",
    SCHEDULER_LABELS,
    multiprocess_mode="livemax",
)
_SCHEDULER_GAUGES = (SCHEDULER_BATCH_LIMIT, SCHEDULER_CONCURRENCY, SCHEDULER_COMPUTE_BOUND, SCHEDULER_THREADS)


def show_choice(labels: tuple[str, str, str], choice) -> None:
    """Show a client graph's scheduler choice (a cost_model.Choice) in the gauges."""
    SCHEDULER_BATCH_LIMIT.labels(*labels).set(choice.batch_limit)
    SCHEDULER_CONCURRENCY.labels(*labels).set(choice.concurrency)
    SCHEDULER_COMPUTE_BOUND.labels(*labels).set(1 if choice.compute_bound else 0)
    SCHEDULER_THREADS.labels(*labels).set(choice.threads)


def forget_choices(labels: set[tuple[str, str, str]]) -> None:
    """Drop the scheduler gauges of client graphs whose model version was unloaded, on a thread of its own. It runs
    as a weakref finalizer, which the garbage collector may run on a thread that holds one of these gauges' locks
    (inside ``labels()``, making a child gauge), and prometheus_client's locks are not reentrant: removing there, the
    thread waited for itself (a test run hung so in show_choice)."""
    threading.Thread(target=_forget, args=(frozenset(labels),), name="servex-forget-choices", daemon=True).start()


def _forget(labels: frozenset[tuple[str, str, str]]) -> None:
    for gauge in _SCHEDULER_GAUGES:
        for label in labels:
            try:
                gauge.remove(*label)
            except KeyError:
                pass
