"""The executor's metrics (executor/metrics.py): the scheduler's gauges, and their removal when a version goes."""

from __future__ import annotations

import threading
import time

from prometheus_client import REGISTRY

from servex.executor.cost_model import Choice
from servex.executor.metrics import SCHEDULER_BATCH_LIMIT, forget_choices, show_choice


def batch_limit(labels: tuple[str, str, str]) -> float | None:
    model, version, signature = labels
    return REGISTRY.get_sample_value(
        "servex_scheduler_batch_limit", {"model": model, "version": version, "signature": signature}
    )


def test_a_versions_gauges_go_even_where_its_finalizer_runs_inside_a_gauges_lock():
    # forget_choices runs as a weakref finalizer: the garbage collector may run it inside show_choice's labels(),
    # on a thread holding the gauge's lock, which is not reentrant. Removing there, the thread waited for itself.
    labels = ("forgotten", "7", "serving_default")
    show_choice(labels, Choice(True, 2, 15, 2))
    assert batch_limit(labels) == 15

    def inside_labels():
        with SCHEDULER_BATCH_LIMIT._lock:  # as inside labels()
            forget_choices({labels})  # returns: the removal waits on its own thread

    thread = threading.Thread(target=inside_labels, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "forget_choices waited for a gauge lock its own thread held"
    deadline = time.monotonic() + 30
    while batch_limit(labels) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batch_limit(labels) is None
