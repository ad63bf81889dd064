"""LoadedClientGraph (executor/client_graph.py): what a built client graph says of itself, and where its runs go:
on its run worker, or (runs alone of a compute-bound graph, where faster) TensorFlow's inter-op pool."""

from __future__ import annotations

import threading

import numpy as np

from servex.executor import GraphExecutor, LoadedClientGraph, client_graph_key, cost_model

X = np.array([[1], [2], [5]], np.float32)
Y = np.array([[2.5], [3.0], [4.5]], np.float32)  # 0.5x + 2


def test_loaded_client_graph_describes_itself(half):
    executor = GraphExecutor(half)
    graph = executor.client_graph(["x2:0", "x:0"], ["y:0", "y3:0", "y:0"])
    assert isinstance(graph, LoadedClientGraph)
    assert graph.key == client_graph_key(["x:0", "x2:0"], ["y:0", "y3:0", "y:0"])
    assert [f.name for f in graph.feeds] == ["x2:0", "x:0"]  # sorted by name
    assert all(f.dtype == np.float32 and f.shape == (None, 1) for f in graph.feeds)
    assert graph.fetch_names == ("y3:0", "y:0")
    assert graph.target_names == ()
    assert graph.build_seconds >= 0
    pending = executor.prepare(["x2:0", "x:0"], ["y:0", "y3:0", "y:0"])  # its variables restored (lazily)
    if pending is not None:
        pending.result(timeout=60)
    assert graph.variables_ready
    # run() takes values in feed order and answers in fetch_names order.
    x2 = np.array([[2]], np.float32)
    y3, y = graph.run([x2, np.array([[4]], np.float32)])
    np.testing.assert_array_equal(y3, [[4.0]])
    np.testing.assert_array_equal(y, [[4.0]])


def test_only_runs_alone_try_or_take_the_inter_op_pool(half):
    executor = GraphExecutor(half)  # ops on the run worker's thread (the default), the pool where it is faster
    graph = executor.client_graph(["x:0"], ["y:0"])
    for _ in range(3):  # under load (another run going, or requests queued): on the worker, and not a trial
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], alone=False)[0], Y)
    assert graph._chooser.pooled is None and graph._pooled is None
    np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    assert graph._chooser.pooled is False  # alone, and small: on its worker from its first run
    # As where runs alone were found faster on the pool: its pooled callable, counted.
    pooled, calls = graph._make_pooled(), []
    graph._pooled = lambda *feeds: calls.append(1) or pooled(*feeds)
    graph._chooser.pooled = True
    np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], alone=False)[0], Y)
    assert calls == []  # a run under load still went on its worker
    np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    assert calls == [1]


def test_the_pooled_callable_is_made_off_the_requests_path(half, monkeypatch):
    # As for a compute-bound graph (every run counts as one), whose pooled callable takes long to make: the runs
    # that would try the pool go on the worker until it is made on the prepare pool, then the trial goes on.
    monkeypatch.setattr(cost_model, "COMPUTE_BOUND_SECONDS", 0.0)
    executor = GraphExecutor(half)
    graph = executor.client_graph(["x:0"], ["y:0"])
    make, release, calls = graph._make_pooled, threading.Event(), []

    def slow_make():
        release.wait(30)
        pooled = make()
        return lambda *feeds: calls.append(1) or pooled(*feeds)

    graph._make_pooled = slow_make
    for _ in range(4):  # worker, pool (being made: on the worker), worker, pool (still being made)
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    assert calls == [] and graph._pooled is None and not graph._making.done()
    release.set()
    graph._making.result(timeout=30)
    for _ in range(4):
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    assert calls == [1, 1]  # every other run, on the pool now
    assert graph._chooser.pooled is None  # still trying: the runs before it was made were on the worker


# -- what the executor rejects ------------------------------------------------------------------------------
