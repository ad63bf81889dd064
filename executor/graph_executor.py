"""GraphExecutor: every run of a model version is a run of a LoadedClientGraph.

A client graph is the model's graph pruned to exactly what one set of feeds, fetches and targets needs. Its key
is the sorted feed names, sorted fetch names and sorted target names, written as TFRT writes it:
``in1-in2^out1-out2^t1-t2``. Feeds are passed to TensorFlow in sorted order and outputs are put back into the
caller's order, so the order in which a caller lists names never changes the result nor creates a second entry.

Each key is built once: the first caller builds it (outside the cache lock), concurrent callers of the same key
wait on that build's future, and callers of other keys never wait on it.
"""

from __future__ import annotations

import difflib
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import config_pb2

from servex.executor.client_graph import FeedSpec, Key, LoadedClientGraph
from servex.executor.memory import BUILD_BYTES_PER_OP, MEMORY
from servex.executor.metrics import CacheMetrics
from servex.executor.op_policy import OpPolicy
from servex.executor.thread_modes import ONE_THREAD, POOL, XLA, ThreadModeChooser
from servex.executor.xla_programs import CONVOLUTIONS, LOOPS, XlaPrograms
from servex.loader.errors import InvalidArgument, ServingError, error_with_code
from servex.loader.saved_model import SavedModelVersion, shape_matches, shape_text, walk
from servex.loader.variables import PREPARE_POOL
from servex.loader.xla import compiled_calls
from servex.transfer import H2DTransferExecutorFactory, make_factory

log = logging.getLogger(__name__)

VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})
# Handles, not values: a session can neither take them as feeds nor answer them as NumPy arrays.
_HANDLE_DTYPES = frozenset({tf.resource, tf.variant})
# A memo from the caller's (unsorted) name tuples to the sorted key; bounded so odd callers cannot grow it.
_MAX_PLANS = 4096


def cache_key(feeds: Sequence[str], fetches: Sequence[str], targets: Sequence[str] = ()) -> Key:
    """The cache's key: sorted feeds, sorted unique fetches, sorted unique targets, as tuples.

    Tuples, not the joined string, so that names containing ``-`` or ``^`` (legal in op names) never collide.
    """
    return tuple(sorted(feeds)), tuple(sorted(set(fetches))), tuple(sorted(set(targets)))


_TRANSFER = threading.local()


def last_transfer() -> tuple[float, float] | None:
    """When this thread's last run moved its inputs to the device (perf_counter start and end), or None."""
    return getattr(_TRANSFER, "span", None)


def client_graph_key(feeds: Sequence[str], fetches: Sequence[str], targets: Sequence[str] = ()) -> str:
    """TFRT's printed key: ``sorted feeds ^ sorted fetches ^ sorted targets``, names joined by ``-``."""
    return "^".join("-".join(names) for names in cache_key(feeds, fetches, targets))


@dataclass(frozen=True)
class _Plan:
    """How one caller's name order maps onto a client graph's sorted order."""

    cid: Hashable  # the cache entry: ("graph", name) or the key
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
    """Runs one loaded model version by tensor names through a bounded cache of LoadedClientGraphs.

    An entry is found by the caller's explicit graph name when given, else by the sorted names. The cache holds
    at most ``max_entries`` unpinned graphs (0: no bound), evicting the least recently used; pinned graphs
    (signature runs, when asked) are never evicted and do not count.
    """

    # This model version's own batching parameters (a RunHandler BatchingOptions, from TensorFlow Serving's
    # per-model batching_params.pbtxt), or None: the server's.
    batching = None

    def __init__(
        self,
        model: SavedModelVersion,
        *,
        transfer: H2DTransferExecutorFactory | None = None,
        run_in_caller_thread: bool = True,
        xla: bool = True,
        max_entries: int = 0,
        metrics: CacheMetrics | None = None,
    ):
        self.model = model
        self._transfer = transfer or make_factory("cpu")
        self._run_in_caller_thread = run_in_caller_thread
        self._xla = xla  # compute-bound graphs of TF2 function calls try XLA (loader/xla.py)
        self.max_entries = max_entries
        self._metrics = metrics or CacheMetrics("", "")
        self._lock = threading.Lock()
        self._graphs: OrderedDict[Hashable, LoadedClientGraph] = OrderedDict()  # least recently used first
        self._building: dict[Hashable, Future] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._unpinned = 0
        self._tensor_names: list[str] | None = None
        self._policy: OpPolicy | None = None  # which state-changing ops client graphs may run; on first build
        self.builds = 0
        self.evictions = 0

    # -- the cache -------------------------------------------------------------------------------------

    def client_graph(
        self,
        feeds: Sequence[str],
        fetches: Sequence[str],
        targets: Sequence[str] = (),
        graph_name: str = "",
        pin: bool = False,
    ) -> LoadedClientGraph:
        """The LoadedClientGraph for these names (or this graph name), built on first use."""
        key = cache_key(feeds, fetches, targets)
        return self._lookup(("graph", graph_name) if graph_name else key, key, graph_name, pin)

    def cached_keys(self) -> list[str]:
        """The printed keys of the built client graphs (explicitly named ones as ``name=key``)."""
        with self._lock:
            return sorted(f"{cid[1]}={g.key}" if cid[0] == "graph" else g.key for cid, g in self._graphs.items())

    def _lookup(self, cid: Hashable, key: Key, graph_name: str, pin: bool) -> LoadedClientGraph:
        graph = self._graphs.get(cid)
        if graph is None:
            graph = self._get_or_build(cid, key, pin)
        else:
            self._metrics.hits.inc()
            with self._lock:  # eviction iterates the table under the lock: never reorder it meanwhile
                if cid in self._graphs:  # else evicted since; the graph in hand is still good for this run
                    self._graphs.move_to_end(cid)
        if graph.names != key:
            raise InvalidArgument(
                f"graph name {graph_name!r} was built for feeds {list(graph.names[0])}, fetches "
                f"{list(graph.names[1])}, targets {list(graph.names[2])}; this call names feeds {list(key[0])}, "
                f"fetches {list(key[1])}, targets {list(key[2])}: use another graph name for another set of names"
            )
        return graph

    def _get_or_build(self, cid: Hashable, key: Key, pin: bool) -> LoadedClientGraph:
        with self._lock:
            graph = self._graphs.get(cid)
            if graph is not None:
                return graph
            future = self._building.get(cid)
            builder = future is None
            if builder:
                future = self._building[cid] = Future()
        self._metrics.misses.inc()
        if not builder:
            return future.result()
        try:
            graph = self._build(key, pin)
        except BaseException as e:
            with self._lock:
                del self._building[cid]
            future.set_exception(e)
            raise
        try:  # waiters get the graph whatever happens to the bookkeeping below
            with self._lock:
                self._graphs[cid] = graph
                del self._building[cid]
                if not pin:
                    self._unpinned += 1
                    self._evict_beyond_bound()
                self._metrics.entries.set(len(self._graphs))
        finally:
            future.set_result(graph)
        return graph

    def _evict_beyond_bound(self) -> None:
        """Drop least recently used unpinned graphs while over the bound (the lock is held)."""
        if not self.max_entries or self._unpinned <= self.max_entries:
            return
        for cid in [cid for cid, g in self._graphs.items() if not g.pinned]:
            if self._unpinned <= self.max_entries:
                break
            evicted = self._graphs.pop(cid)
            self._unpinned -= 1
            self.evictions += 1
            self._metrics.evictions.inc()
            log.debug("evicted client graph %s", evicted.key)
        self._plans.clear()  # plans only name keys, but keep the memo in step with what is cached

    def _build(self, key: Key, pin: bool) -> LoadedClientGraph:
        start = time.perf_counter()
        feeds, fetch_names, target_names = key
        if not fetch_names and not target_names:
            raise InvalidArgument("nothing to run: give at least one fetch or one target")
        if len(set(feeds)) != len(feeds):
            raise InvalidArgument(f"a tensor is fed more than once: {list(feeds)}")
        feed_tensors = [self._tensor(n, "feed") for n in feeds]
        fetch_tensors = [self._tensor(n, "fetch") for n in fetch_names]
        target_ops = [self._operation(n) for n in target_names]
        for t in feed_tensors:
            if t.dtype.base_dtype in _HANDLE_DTYPES:
                raise InvalidArgument(
                    f"cannot feed {t.name!r}: it is a {_dtype_name(t.dtype)} tensor (a handle to a variable or "
                    f"other resource, or an opaque variant); resource and variant tensors cannot be fed"
                )
        for t in fetch_tensors:
            if t.dtype.base_dtype in _HANDLE_DTYPES:
                raise InvalidArgument(
                    f"cannot fetch {t.name!r}: it is a {_dtype_name(t.dtype)} tensor (a handle to a variable or "
                    f"other resource, or an opaque variant), which has no value to send back; fetch a tensor "
                    f"that reads it instead"
                )
        # The ops the pruned graph runs: state-changing ones only as the model's signatures run them.
        fed = frozenset(t.name for t in feed_tensors)
        ops = walk([t.op for t in fetch_tensors] + target_ops, fed)
        self._op_policy().check(ops, fed)
        printed = client_graph_key(*key)
        options = config_pb2.CallableOptions(feed=[t.name for t in feed_tensors], fetch=list(fetch_names))
        options.target.extend(target_names)
        if self._run_in_caller_thread:
            options.run_options.inter_op_thread_pool = -1
        # Session.MakeCallable prunes the graph to what these feeds/fetches/targets need and builds its
        # executors now, so the first run pays nothing more.
        # A graph that runs on its worker may run its lone runs on TensorFlow's inter-op pool instead (thread_modes.py):
        # that callable is made after its first lone run, where the pool may be tried (client_graph.py).
        chooser, makers, releases = None, {}, {}
        if self._run_in_caller_thread:  # compute-bound graphs may run faster otherwise (thread_modes.py)
            chooser, makers, releases = self._modes(options, ops, printed)
        need = MEMORY.admit(len(ops) * BUILD_BYTES_PER_OP, "build", f"building client graph {printed!r}")
        try:
            fn = self.model.session._make_callable_from_options(options)
        except tf.errors.OpError as e:  # e.g. a tensor both fed and fetched
            raise error_with_code(e.error_code, f"cannot build client graph {printed!r}: {e.message}") from e
        finally:
            MEMORY.release(need)
        specs = tuple(
            FeedSpec(
                name=t.name,
                dtype=np.dtype(t.dtype.as_numpy_dtype),
                shape=None if t.shape.rank is None else tuple(t.shape.as_list()),
            )
            for t in feed_tensors
        )
        variables = frozenset(op.name for op in ops if op.type in VARIABLE_OPS)
        seconds = time.perf_counter() - start
        self.builds += 1
        self._metrics.builds.inc()
        self._metrics.build_seconds.observe(seconds)
        log.debug("built client graph %s in %.3fs (reads %d variables)", printed, seconds, len(variables))
        graph = LoadedClientGraph(printed, key, specs, fetch_names, target_names, variables, seconds, pin, fn)
        graph._chooser, graph._makers, graph._releases = chooser, makers, releases
        if XLA in makers:
            graph._xla = XlaPrograms(printed, lambda: graph._made.get(XLA), graph._gate, graph._run, graph._xla_failed)
        return graph

    def _modes(self, options, ops, printed: str):
        """For a graph on its run worker: the chooser of its lone runs' mode, what makes each other mode's callable,
        and what gives each twin session back (thread_modes.py)."""
        pooled_options = config_pb2.CallableOptions()
        pooled_options.CopyFrom(options)
        pooled_options.run_options.inter_op_thread_pool = 0
        makers = {POOL: functools.partial(self._pooled_callable, pooled_options, len(ops), printed)}
        releases = {}
        # A graph that changes no state may run in the version's other sessions, which hold the same values.
        stateless = not any(self._op_policy().kinds(op) for op in ops)
        twins = {ONE_THREAD: self.model.one_thread}
        calls = self._xla_calls(ops)
        if calls:
            twins[XLA] = self.model.xla
        for mode, twin in twins.items():
            if twin is not None and twin.available() and stateless:
                makers[mode] = functools.partial(self._twin_callable, twin, options, printed)
                releases[mode] = twin.release
        # (the cores its runs may spread over: TensorFlow's pools' threads, which servex sizes at start)
        pools = tf.config.threading
        cores = max(pools.get_intra_op_parallelism_threads(), pools.get_inter_op_parallelism_threads())
        # A loop's XLA trial waits for no busy cores: how busy a loop of tiny ops keeps the cores is its spinning
        # threads' (a GRU's lone runs read 1.46 and 1.80 in two starts on one host), not its ops' (xla_programs.py).
        policy = self._op_policy()
        loops = XLA in makers and any(policy.types(op) & LOOPS for op in ops if op.name in calls)
        chooser = ThreadModeChooser(printed, tuple(makers), cores or None, ungated=(XLA,) if loops else ())
        return chooser, makers, releases

    def _pooled_callable(self, options: config_pb2.CallableOptions, ops: int, printed: str):
        """The graph's callable whose ops go on TensorFlow's inter-op pool, its memory admitted as a build's (a trial's:
        refused, the graph's runs stay on its worker and no call is refused)."""
        need = MEMORY.admit(ops * BUILD_BYTES_PER_OP, "trial", f"building client graph {printed!r} for the pool")
        try:
            return self.model.session._make_callable_from_options(options)
        finally:
            MEMORY.release(need)

    def _xla_calls(self, ops) -> frozenset[str]:
        """The function calls of the graph the XLA session compiles, where XLA is tried at all: where it is on, and
        none of them runs a convolution (xla_programs.py); else none."""
        if not self._xla:
            return frozenset()
        calls = compiled_calls(ops) & getattr(self.model.xla, "calls", frozenset())
        policy = self._op_policy()
        return frozenset() if any(policy.types(op) & CONVOLUTIONS for op in ops if op.name in calls) else calls

    def _twin_callable(self, twin, options: config_pb2.CallableOptions, printed: str):
        """The client graph's callable in one of the version's other sessions (loader/one_thread.py, loader/xla.py:
        made, and its variables copied into it, on the first call), or None where there is none to have. Its
        memory: the version's restored variables again, admitted first (as a trial's, like ``_pooled_callable``)."""
        store = self.model.variables
        size = sum(r.nbytes for n, r in store.records.items() if store.loaded.placed(n, store.device))
        need = MEMORY.admit(size, "trial", f"a second session ({twin.what}) for client graph {printed!r}")
        try:
            session = twin.acquire()
        finally:
            MEMORY.release(need)
        if session is None:
            return None
        try:
            return session._make_callable_from_options(options)
        except BaseException:
            twin.release()
            raise

    def _op_policy(self) -> OpPolicy:
        """The model's OpPolicy, made once (two first builds at once may both make it: the same, harmless)."""
        policy = self._policy
        if policy is None:
            model = self.model
            policy = self._policy = OpPolicy(
                model.graph, model.meta_graph.graph_def.library, model.signatures, model.signature_ops
            )
        return policy

    def _tensor(self, name: str, role: str):
        try:
            return self.model.graph.get_tensor_by_name(name)
        except (KeyError, ValueError, TypeError) as e:
            raise InvalidArgument(
                f"cannot {role} {name!r}: no such tensor in the model's graph "
                f"(tensor names look like 'op_name:0'){self._suggest(name, tensors=True)}"
            ) from e

    def _operation(self, name: str):
        try:
            return self.model.graph.get_operation_by_name(name)
        except (KeyError, ValueError, TypeError) as e:
            raise InvalidArgument(
                f"cannot run target {name!r}: no such operation in the model's graph"
                f"{self._suggest(name, tensors=False)}"
            ) from e

    def _suggest(self, name: str, tensors: bool) -> str:
        ops = self.model.graph.get_operations()
        if tensors:
            candidates = [t.name for op in ops for t in op.outputs]
        else:
            candidates = [op.name for op in ops]
        close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
        return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""

    # -- running ---------------------------------------------------------------------------------------

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        fetches: Sequence[str],
        targets: Sequence[str] = (),
        graph_name: str = "",
        pin: bool = False,
        alone: bool = True,
    ) -> list[np.ndarray]:
        """Run with ``inputs`` by tensor name; returns the ``fetches`` values in the caller's order.

        ``graph_name`` names the client graph explicitly (its cache entry is found by that name, and the name
        must keep meaning the same names); ``pin`` keeps the graph out of eviction; ``alone`` (the RunHandler's
        word): no other run of the graph goes and none waits (LoadedClientGraph.run). Raises InvalidArgument for
        unknown names, resource or variant feeds and fetches, and inputs whose dtype or shape the graph rejects;
        PermissionDenied for a graph that would run a state-changing or file op other than as a signature runs it
        (``executor/op_policy.py``). The outputs are ndarrays, 0-d ones included.
        """
        names = tuple(inputs)
        plan_key = (graph_name, names, tuple(fetches), tuple(targets))
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._plan(plan_key)
        graph = self._lookup(plan.cid, plan.key, graph_name, pin)
        if not graph.variables_ready:
            self._restore_variables(graph)
        values = list(inputs.values())
        ordered = [values[i] for i in plan.feed_order]
        for spec, value in zip(graph.feeds, ordered, strict=True):
            _check_feed(spec, value)
        # One H2DTransferExecutor run for all inputs (CPU: aligned as TensorFlow takes them without a copy).
        started = time.perf_counter()
        ordered = self._transfer.transfer(ordered)
        _TRANSFER.span = (started, time.perf_counter())  # for a traced request's transfer span (executor/work.py)
        gate = self.model.variables.gate
        if gate is not None:
            gate.enter()
        try:
            results = graph.run(ordered, alone)
        except tf.errors.OpError as e:  # TensorFlow's own check failed: keep its status code and words
            raise error_with_code(e.error_code, f"running {graph.key!r} failed: {e.message}") from e
        finally:
            if gate is not None:
                gate.leave()
        return [results[i] for i in plan.fetch_index]

    def prepare(
        self,
        feeds: Sequence[str],
        fetches: Sequence[str],
        targets: Sequence[str] = (),
        graph_name: str = "",
        pin: bool = False,
    ) -> Future | None:
        """None when the client graph for these names is built and its variables are on the device (the usual
        case); else a future that completes when they are, doing the build and the restores on the restore pool,
        so that the caller can wait without holding a run worker."""  # fmt: skip
        plan_key = (graph_name, tuple(feeds), tuple(fetches), tuple(targets))
        plan = self._plans.get(plan_key) or self._plan(plan_key)
        graph = self._graphs.get(plan.cid)
        if graph is not None and graph.variables_ready:
            return None
        return PREPARE_POOL.submit(self._prepare, plan, graph_name, pin)

    def _prepare(self, plan: _Plan, graph_name: str, pin: bool) -> int:
        """Build the client graph and restore its variables; how many variables this waited for."""
        graph = self._lookup(plan.cid, plan.key, graph_name, pin)
        return 0 if graph.variables_ready else self._restore_variables(graph)

    def _restore_variables(self, graph: LoadedClientGraph) -> int:
        """Lazy restoration: the variables this client graph reads, each restored once, before its first run;
        returns how many were not on the device yet."""
        store = self.model.variables
        need = 0
        unread = [n for n in graph.variables if n in store.records and not store.loaded.placed(n, store.device)]
        if MEMORY.limit:  # the variables' own sizes, from the checkpoint's index
            size = sum(store.records[n].nbytes for n in unread)
            need = MEMORY.admit(size, "restore", f"restoring {len(unread)} variable(s) of {graph.key!r}")
        try:
            pending = store.ensure(graph.variables)
            if pending is not None:
                pending.result()
        except ServingError:
            raise
        except Exception as e:
            raise error_with_code(13, f"restoring the variables of {graph.key!r} failed: {e}") from e
        finally:
            MEMORY.release(need)
        graph.variables_ready = True
        return len(unread)

    def _plan(self, plan_key: tuple) -> _Plan:
        graph_name, feeds, fetches, targets = plan_key
        key = cache_key(feeds, fetches, targets)
        plan = _Plan(
            cid=("graph", graph_name) if graph_name else key,
            key=key,
            feed_order=tuple(sorted(range(len(feeds)), key=feeds.__getitem__)),
            fetch_index=tuple(key[1].index(n) for n in fetches),
        )
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[plan_key] = plan
        return plan

    def close(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._plans.clear()
        self._metrics.remove()
        self.model.variables.hooks.remove()
        self.model.close()


def _dtype_name(dtype) -> str:
    return types_pb2.DataType.Name(dtype.base_dtype.as_datatype_enum)
