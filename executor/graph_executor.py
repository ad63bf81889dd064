"""GraphExecutor: every run of a model version is a run of a LoadedClientGraph.

A client graph is the model's graph pruned to exactly what one set of feeds, fetches and targets needs. Its key
is the sorted feed names, sorted fetch names and sorted target names, written as TFRT writes it:
``in1-in2^out1-out2^t1-t2``. Feeds are passed to TensorFlow in sorted order and outputs are put back into the
caller's order, so the order in which a caller lists names never changes the result nor creates a second entry.

Each key is built once: the first caller builds it (outside the cache lock), concurrent callers of the same key
wait on that build's future, and callers of other keys never wait on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from loader.errors import InvalidArgument, error_with_code
from loader.saved_model import SavedModelVersion, shape_matches, shape_text
from transfer import H2DTransferExecutorFactory, make_factory

log = logging.getLogger(__name__)

VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})
# A memo from the caller's (unsorted) name tuples to the sorted key; bounded so odd callers cannot grow it.
_MAX_PLANS = 4096


Key = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def cache_key(feeds: Sequence[str], fetches: Sequence[str], targets: Sequence[str] = ()) -> Key:
    """The cache's key: sorted feeds, sorted unique fetches, sorted unique targets, as tuples.

    Tuples, not the joined string, so that names containing ``-`` or ``^`` (legal in op names) never collide.
    """
    return tuple(sorted(feeds)), tuple(sorted(set(fetches))), tuple(sorted(set(targets)))


def client_graph_key(feeds: Sequence[str], fetches: Sequence[str], targets: Sequence[str] = ()) -> str:
    """TFRT's printed key: ``sorted feeds ^ sorted fetches ^ sorted targets``, names joined by ``-``."""
    return "^".join("-".join(names) for names in cache_key(feeds, fetches, targets))


@dataclass(frozen=True)
class FeedSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...] | None  # None: unknown rank


@dataclass(frozen=True)
class LoadedClientGraph:
    """A built client graph: the session callable over the pruned graph and what it needs."""

    key: str
    feeds: tuple[FeedSpec, ...]  # sorted by name
    fetch_names: tuple[str, ...]  # sorted, unique
    target_names: tuple[str, ...]  # sorted, unique
    variables: frozenset[str]  # variable ops the pruned graph reads
    build_seconds: float
    _callable: object

    def run(self, sorted_feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run with feed values in ``feeds`` order; returns fetches in ``fetch_names`` order."""
        return self._callable(*sorted_feeds)


@dataclass(frozen=True)
class _Plan:
    """How one caller's name order maps onto a client graph's sorted order."""

    key: Key
    feed_order: tuple[int, ...]  # caller's feed positions, in the graph's sorted feed order
    fetch_index: tuple[int, ...]  # for each caller fetch, its position in the graph's sorted fetches


def _check_feed(spec: FeedSpec, value: np.ndarray) -> None:
    if value.dtype != spec.dtype:
        raise InvalidArgument(f"input tensor {spec.name!r}: expected dtype {spec.dtype.name}, got {value.dtype.name}")
    if not shape_matches(spec.shape, value.shape):
        raise InvalidArgument(
            f"input tensor {spec.name!r}: expected shape {shape_text(spec.shape)}, got {list(value.shape)}"
        )


class GraphExecutor:
    """Runs one loaded model version by tensor names through a cache of LoadedClientGraphs."""

    def __init__(
        self,
        model: SavedModelVersion,
        *,
        transfer: H2DTransferExecutorFactory | None = None,
        run_in_caller_thread: bool = True,
    ):
        self.model = model
        self._transfer = transfer or make_factory("cpu")
        self._run_in_caller_thread = run_in_caller_thread
        self._lock = threading.Lock()
        self._graphs: dict[Key, LoadedClientGraph] = {}
        self._building: dict[Key, Future] = {}
        self._plans: dict[tuple, _Plan] = {}
        self.builds = 0

    # -- the cache -------------------------------------------------------------------------------------

    def client_graph(
        self, feeds: Sequence[str], fetches: Sequence[str], targets: Sequence[str] = ()
    ) -> LoadedClientGraph:
        """The LoadedClientGraph for these names, built on first use; any name order gives the same one."""
        return self._get_or_build(cache_key(feeds, fetches, targets))

    def cached_keys(self) -> list[str]:
        """The printed keys of the built client graphs."""
        with self._lock:
            return sorted(graph.key for graph in self._graphs.values())

    def _get_or_build(self, key: Key) -> LoadedClientGraph:
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None:
                return graph
            future = self._building.get(key)
            builder = future is None
            if builder:
                future = self._building[key] = Future()
        if not builder:
            return future.result()
        try:
            graph = self._build(key)
        except BaseException as e:
            with self._lock:
                del self._building[key]
            future.set_exception(e)
            raise
        with self._lock:
            self._graphs[key] = graph
            del self._building[key]
        future.set_result(graph)
        return graph

    def _build(self, key: Key) -> LoadedClientGraph:
        start = time.perf_counter()
        feeds, fetch_names, target_names = key
        if len(set(feeds)) != len(feeds):
            raise InvalidArgument(f"a tensor is fed more than once: {list(feeds)}")
        feed_tensors = [self._tensor(n, "feed") for n in feeds]
        fetch_tensors = [self._tensor(n, "fetch") for n in fetch_names]
        target_ops = [self._operation(n) for n in target_names]
        printed = client_graph_key(*key)
        options = config_pb2.CallableOptions(feed=[t.name for t in feed_tensors], fetch=list(fetch_names))
        options.target.extend(target_names)
        if self._run_in_caller_thread:
            options.run_options.inter_op_thread_pool = -1
        # Session.MakeCallable prunes the graph to what these feeds/fetches/targets need and builds its
        # executors now, so the first run pays nothing more.
        try:
            fn = self.model.session._make_callable_from_options(options)
        except tf.errors.OpError as e:  # e.g. a tensor both fed and fetched
            raise error_with_code(e.error_code, f"cannot build client graph {printed!r}: {e.message}") from e
        specs = tuple(
            FeedSpec(
                name=t.name,
                dtype=np.dtype(t.dtype.as_numpy_dtype),
                shape=None if t.shape.rank is None else tuple(t.shape.as_list()),
            )
            for t in feed_tensors
        )
        variables = _variables_read(fetch_tensors, target_ops, feed_tensors)
        seconds = time.perf_counter() - start
        self.builds += 1
        log.debug("built client graph %s in %.3fs (reads %d variables)", printed, seconds, len(variables))
        return LoadedClientGraph(printed, specs, fetch_names, target_names, variables, seconds, fn)

    def _tensor(self, name: str, role: str):
        try:
            return self.model.graph.get_tensor_by_name(name)
        except (KeyError, ValueError, TypeError) as e:
            raise InvalidArgument(
                f"cannot {role} {name!r}: no such tensor in the graph of {self.model.path!r} "
                f"(tensor names look like 'op_name:0')"
            ) from e

    def _operation(self, name: str):
        try:
            return self.model.graph.get_operation_by_name(name)
        except (KeyError, ValueError, TypeError) as e:
            raise InvalidArgument(f"cannot run target {name!r}: no such operation in {self.model.path!r}") from e

    # -- running ---------------------------------------------------------------------------------------

    def run(
        self, inputs: Mapping[str, np.ndarray], fetches: Sequence[str], targets: Sequence[str] = ()
    ) -> list[np.ndarray]:
        """Run with ``inputs`` by tensor name; returns the ``fetches`` values in the caller's order.

        Raises InvalidArgument for unknown names and for inputs whose dtype or shape the graph rejects.
        """
        names = tuple(inputs)
        plan_key = (names, tuple(fetches), tuple(targets))
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._plan(names, plan_key[1], plan_key[2])
        graph = self._graphs.get(plan.key) or self._get_or_build(plan.key)
        values = list(inputs.values())
        ordered = [values[i] for i in plan.feed_order]
        for spec, value in zip(graph.feeds, ordered, strict=True):
            _check_feed(spec, value)
        if not self._transfer.passthrough:
            h2d = self._transfer.create()
            pending = [h2d.schedule(v) for v in ordered]
            h2d.run()
            ordered = [f.result() for f in pending]
        try:
            results = graph.run(ordered)
        except tf.errors.OpError as e:  # TensorFlow's own check failed: keep its status code and words
            raise error_with_code(e.error_code, f"running {graph.key!r} failed: {e.message}") from e
        return [results[i] for i in plan.fetch_index]

    def _plan(self, feeds: tuple[str, ...], fetches: tuple[str, ...], targets: tuple[str, ...]) -> _Plan:
        key = cache_key(feeds, fetches, targets)
        plan = _Plan(
            key=key,
            feed_order=tuple(sorted(range(len(feeds)), key=feeds.__getitem__)),
            fetch_index=tuple(key[1].index(n) for n in fetches),
        )
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[(feeds, fetches, targets)] = plan
        return plan

    def close(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._plans.clear()
        self.model.close()


def _variables_read(fetch_tensors, target_ops, feed_tensors) -> frozenset[str]:
    """Names of the variable ops reachable from the fetches and targets without crossing a feed."""
    fed = {t.name for t in feed_tensors}
    seen, found = set(), set()
    stack = [t.op for t in fetch_tensors] + list(target_ops)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in VARIABLE_OPS:
            found.add(op.name)
        stack.extend(t.op for t in op.inputs if t.name not in fed)
        stack.extend(op.control_inputs)
    return frozenset(found)
