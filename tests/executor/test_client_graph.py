"""LoadedClientGraph (executor/client_graph.py): what a built client graph says of itself, and where its runs go:
on its run worker, or (runs alone of a compute-bound graph, where faster) TensorFlow's inter-op pool."""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from servex.executor import GraphExecutor, LoadedClientGraph, client_graph_key, thread_modes
from servex.executor.thread_modes import ONE_THREAD, POOL, WORKER
from servex.loader import load_saved_model
from servex.loader.one_thread import PER_SESSION_POOLS
from tests.conftest import COUNTER, HALF_PLUS_TWO_TF1
from tests.support.daemon import wait_for

TWO_THREADS = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=2, inter_op_parallelism_threads=2)

X = np.array([[1], [2], [5]], np.float32)
Y = np.array([[2.5], [3.0], [4.5]], np.float32)  # 0.5x + 2


def per_session_model(monkeypatch, path=HALF_PLUS_TWO_TF1):
    """The model on two threads, each session owning its pool: a client graph may try a one-thread session."""
    monkeypatch.setenv(PER_SESSION_POOLS, "1")
    return load_saved_model(str(path / "00000123"), session_config=TWO_THREADS)


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
    assert graph._chooser.mode is None and graph._made == {}  # nothing but its own callable made with the graph
    np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    assert graph._chooser.mode == WORKER  # alone, and small: on its worker from its first run
    assert POOL not in graph._made  # and its pooled callable never made
    # As where runs alone were found faster on the pool: its pooled callable, counted.
    pooled, calls = graph._makers[POOL](), []
    graph._made[POOL] = lambda *feeds: calls.append(1) or pooled(*feeds)
    graph._chooser.mode = POOL
    np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], alone=False)[0], Y)
    assert calls == []  # a run under load still went on its worker
    np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    assert calls == [1]


def test_the_pooled_callable_is_made_after_the_first_lone_run_not_beside_the_runs(half, monkeypatch):
    # Making a callable holds the session's runs while TensorFlow's optimizers go over the graph (a MobileNetV2 run
    # of 30 ms took 1.0-1.4 s beside it): the pooled one is made on the worker right after the graph's first lone
    # run, before its answer, and no trial makes one beside the runs.
    monkeypatch.setattr(thread_modes, "COMPUTE_BOUND_SECONDS", 0.0)  # as for a compute-bound graph
    executor = GraphExecutor(half)
    graph = executor.client_graph(["x:0"], ["y:0"])
    assert graph._made == {}
    maker, calls = graph._makers[POOL], []

    def make():
        pooled = maker()
        return lambda *feeds: calls.append(1) or pooled(*feeds)

    graph._makers[POOL] = make
    np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], alone=False)[0], Y)  # under load: nothing made
    assert graph._made == {} and POOL in graph._makers
    for _ in range(4):  # worker, pool, worker, pool: the trial takes turns from its first runs
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    assert calls == [1, 1] and graph._making == {} and POOL not in graph._makers  # made once, by the first run
    assert graph._chooser.mode is None  # still trying


def test_the_pooled_callable_is_never_made_where_the_first_run_kept_the_cores_over_its_line(half, monkeypatch):
    # ResNet-50 on 2 cores: its first lone run kept 1.66 cores busy, over the pool's line (1.6): the pool would never
    # be tried (the most of the first runs decides), so its callable (1.2 s of the first request) is not made.
    monkeypatch.setattr(thread_modes, "COMPUTE_BOUND_SECONDS", 0.0)
    for share, made in ((0.0, False), (10.0, True)):  # the line at no cores busy, and at 20 (of 2)
        monkeypatch.setattr(thread_modes, "POOL_BUSY_SHARE", share)
        executor = GraphExecutor(half)
        graph = executor.client_graph(["x:0"], ["y:0"])
        graph._chooser = thread_modes.ThreadModeChooser(graph.key, tuple(graph._chooser.modes), cores=2)
        assert POOL not in graph._chooser.modes and graph._chooser.gated  # it waits for the busy cores
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
        assert (POOL in graph._made) == made and POOL not in graph._makers
        assert graph._chooser.may_try(POOL, 0.0) == made  # dropped where not made


def test_a_graph_that_keeps_one_thread_runs_there_alone_and_under_load(testdata, monkeypatch):
    # As where its lone runs were found faster with one intra-op thread: every run goes in the version's second
    # session, with the same answers; a graph that chose another mode gives the session back, and it closes.
    model = per_session_model(monkeypatch)
    try:
        executor = GraphExecutor(model)
        graph = executor.client_graph(["x:0"], ["y:0"])
        assert graph._chooser.modes == [WORKER, POOL] and graph._chooser.gated  # one thread: once measured
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], alone=False)[0], Y)  # restored
        assert graph._mode_callable(ONE_THREAD) is None  # being made, on the prepare pool
        graph._making[ONE_THREAD].result(timeout=30)
        made, calls = graph._made[ONE_THREAD], []
        assert made._session is model.one_thread._session  # a callable of the second session
        graph._made[ONE_THREAD] = lambda *feeds: calls.append(1) or made(*feeds)
        graph._chooser.mode = ONE_THREAD
        for alone in (True, False):
            np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], alone=alone)[0], Y)
        assert calls == [1, 1]
        # Another graph of the version tries it too, and keeps its worker: its share is given back.
        other = executor.client_graph(["x:0"], ["y2:0"])
        other._mode_callable(ONE_THREAD)
        other._making[ONE_THREAD].result(timeout=30)
        assert model.one_thread._users == 2
        other._chooser.mode = WORKER
        other._settle(WORKER)
        assert ONE_THREAD not in other._made
        wait_for(lambda: model.one_thread._users == 1, what="the other graph's share given back")
        graph._settle(ONE_THREAD)  # kept
        assert model.one_thread._users == 1 and len(model.variables._sessions) == 2
        graph._made[ONE_THREAD] = made
        graph._settle(WORKER)  # as if it had chosen otherwise: the last user, so the session closes
        wait_for(lambda: model.one_thread._session is None, what="the session closed")
        assert model.variables._sessions == [model.session]
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)  # on its worker again
    finally:
        model.close()


def test_a_graph_on_the_pool_alone_runs_under_load_on_one_thread_where_that_beat_its_worker(testdata, monkeypatch):
    # As where its lone runs were fastest on the pool and one thread beat its worker: alone on the pool, under load
    # in the one-thread session, which is kept; the same answers everywhere.
    model = per_session_model(monkeypatch)
    try:
        executor = GraphExecutor(model)
        graph = executor.client_graph(["x:0"], ["y:0"])
        graph._mode_callable(ONE_THREAD)
        graph._making[ONE_THREAD].result(timeout=30)
        pooled, one, calls = graph._makers[POOL](), graph._made[ONE_THREAD], []
        graph._made[POOL] = lambda *feeds: calls.append(POOL) or pooled(*feeds)
        graph._made[ONE_THREAD] = lambda *feeds: calls.append(ONE_THREAD) or one(*feeds)
        graph._chooser.mode, graph._chooser.under_load = POOL, ONE_THREAD
        graph._settle(POOL)
        for alone in (True, False, True):
            np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], alone=alone)[0], Y)
        assert calls == [POOL, ONE_THREAD, POOL]
        assert ONE_THREAD in graph._made and model.one_thread._users == 1  # not given back
    finally:
        model.close()


def test_a_session_given_back_closes_off_the_settling_thread_and_outside_the_gate(testdata, monkeypatch):
    # Closing a second session takes tens of milliseconds (DenseNet-121's one-thread session 57 ms): neither the
    # run whose trial settled the mode (on its worker) nor the graph's next runs (held by the gate) wait for it.
    model = per_session_model(monkeypatch)
    try:
        executor = GraphExecutor(model)
        graph = executor.client_graph(["x:0"], ["y:0"])
        graph._mode_callable(ONE_THREAD)
        graph._making[ONE_THREAD].result(timeout=30)
        release, seen = graph._releases[ONE_THREAD], []

        def watched() -> None:
            seen.append((threading.current_thread(), graph._gate._writing))
            release()

        graph._releases[ONE_THREAD] = watched
        graph._chooser.mode = WORKER
        graph._settle(WORKER)
        assert ONE_THREAD not in graph._made  # let go at once: no run takes it again
        wait_for(lambda: model.one_thread._session is None, what="the session closed")
        ((thread, gated),) = seen
        assert thread is not threading.current_thread() and not gated
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)  # on its worker
    finally:
        model.close()


def test_a_graph_that_changes_state_never_tries_a_second_session(testdata, monkeypatch):
    # Its runs change the version's state (a counter): a second session would hold another counter.
    model = per_session_model(monkeypatch, COUNTER)
    try:
        executor = GraphExecutor(model)
        incr = model.signatures["incr_counter"].outputs["output"].name
        value = model.signatures["get_counter"].outputs["output"].name
        assert not executor.client_graph([], [incr])._chooser.gated
        assert executor.client_graph([], [value])._chooser.gated  # one thread may join its trial
    finally:
        model.close()


def test_a_pool_not_made_for_want_of_memory_refuses_no_call(half, monkeypatch):
    # Under a memory limit with no room left, the pooled callable (a trial's) is not made: the run goes on its
    # worker, answered, and the refusal is counted as a trial's, not as a build's.
    from prometheus_client import REGISTRY

    from servex.executor.memory import MEMORY

    def refused(what: str) -> float:
        return REGISTRY.get_sample_value("servex_memory_refused_total", {"what": what}) or 0.0

    monkeypatch.setattr(thread_modes, "COMPUTE_BOUND_SECONDS", 0.0)  # as for a compute-bound graph
    executor = GraphExecutor(half)
    graph = executor.client_graph(["x:0"], ["y:0"])
    pending = executor.prepare(["x:0"], ["y:0"])
    if pending is not None:
        pending.result(timeout=60)
    trials, builds = refused("trial"), refused("build")
    MEMORY.configure(1, "a test's limit")  # usable: none
    try:
        np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"])[0], Y)
    finally:
        MEMORY.configure(0, "")
    assert POOL not in graph._made and POOL not in graph._makers and not graph._chooser.may_try(POOL, 0.0)
    assert refused("trial") == trials + 1 and refused("build") == builds


# -- what the executor rejects ------------------------------------------------------------------------------
