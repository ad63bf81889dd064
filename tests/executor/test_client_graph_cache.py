"""GraphExecutor's client-graph cache under threads: each key built once, failed builds not kept, hits and
evictions from many threads keeping the LRU table consistent."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

from servex.executor import GraphExecutor
from servex.loader import InvalidArgument

X = np.array([[1], [2], [5]], np.float32)
Y = np.array([[2.5], [3.0], [4.5]], np.float32)  # 0.5x + 2


# -- building each key once ---------------------------------------------------------------------------------


def _in_threads(n: int, fn):
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = [None] * n

    def work(i):
        barrier.wait(timeout=30)
        try:
            results[i] = fn(i)
        except BaseException as e:  # handed to the test
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_one_build_per_key_under_concurrency(half):
    executor = GraphExecutor(half)
    graphs, errors = _in_threads(16, lambda i: executor.client_graph(["x:0"], ["y2:0", "y:0"]))
    assert errors == [None] * 16
    assert executor.builds == 1
    assert all(g is graphs[0] for g in graphs)
    assert executor.cached_keys() == ["x:0^y2:0-y:0^"]


def test_concurrent_runs_on_a_cold_key(half):
    executor = GraphExecutor(half)

    def run(i):
        fetches = ["y:0", "y2:0"] if i % 2 else ["y2:0", "y:0"]
        got = dict(zip(fetches, executor.run({"x:0": X + i}, fetches), strict=True))
        return got["y:0"], got["y2:0"]

    results, errors = _in_threads(16, run)
    assert errors == [None] * 16
    assert executor.builds == 1
    assert len(executor.cached_keys()) == 1
    for i, (y, y2) in enumerate(results):
        np.testing.assert_array_equal(y, 0.5 * (X + i) + 2)
        np.testing.assert_array_equal(y2, 0.5 * (X + i) + 3)


def test_failed_build_is_not_cached(half):
    executor = GraphExecutor(half)
    _, errors = _in_threads(8, lambda i: executor.client_graph(["x:0"], ["y:0", "bad:0"]))
    assert all(isinstance(e, InvalidArgument) and "'bad:0'" in e.message for e in errors)
    assert executor.cached_keys() == []
    assert executor.builds == 0
    with pytest.raises(InvalidArgument, match="bad:0"):  # tried again, not answered from a cache
        executor.run({"x:0": X}, ["y:0", "bad:0"])
    (y,) = executor.run({"x:0": X}, ["y:0"])
    np.testing.assert_array_equal(y, Y)
    assert executor.builds == 1
    assert executor.cached_keys() == ["x:0^y:0^"]


def test_other_keys_do_not_share_an_entry(half):
    executor = GraphExecutor(half)
    executor.run({"x:0": X}, ["y:0"])
    executor.run({"x:0": X}, ["y2:0"])
    executor.run({"x2:0": X}, ["y3:0"])
    assert executor.cached_keys() == ["x2:0^y3:0^", "x:0^y2:0^", "x:0^y:0^"]
    assert executor.builds == 3


# -- evictions while hits reorder the table ------------------------------------------------------------------


class _SlowToIterate(collections.OrderedDict):
    """The cache's LRU table, iterating slowly: a reorder during an eviction's scan then fails loudly."""

    def items(self):
        for item in super().items():
            yield item
            time.sleep(0.05)


def test_a_hit_during_an_eviction_scan_waits_for_it(half):
    executor = GraphExecutor(half, max_entries=1)
    executor.run({"x:0": X}, ["y:0"], graph_name="hot")
    executor._graphs = _SlowToIterate(executor._graphs)
    stop = threading.Event()
    hit_errors = []

    def hits():
        while not stop.is_set():
            try:
                executor.run({"x:0": X}, ["y:0"], graph_name="hot")
            except Exception as e:  # noqa: BLE001 (reported below)
                hit_errors.append(e)

    hitter = threading.Thread(target=hits)
    hitter.start()
    try:
        for name in ("cold1", "cold2", "cold3"):  # each build evicts, scanning the table slowly
            np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], graph_name=name)[0], Y)
    finally:
        stop.set()
        hitter.join(30)
    assert hit_errors == []
    assert executor.evictions >= 3  # the hitter's rebuilds of 'hot' evict too
    assert len(executor.cached_keys()) == 1


def test_hits_and_evictions_from_many_threads_keep_the_cache_consistent(half):
    # Hits reorder the LRU table while builds evict from it: both under the cache's lock, or eviction's
    # iteration fails with "OrderedDict mutated during iteration".
    executor = GraphExecutor(half, max_entries=2)
    names = [f"g{i}" for i in range(5)]

    def work(i):
        for j in range(150):
            name = names[(i + j) % len(names)] if j % 3 else names[0]  # g0 hot, the others churn
            np.testing.assert_array_equal(executor.run({"x:0": X}, ["y:0"], graph_name=name)[0], Y)

    _, errors = _in_threads(6, work)
    assert errors == [None] * 6
    assert len(executor.cached_keys()) <= 2
    assert executor.evictions > 0
