"""ServingCore: the one data plane every protocol adapter calls.

It resolves model, version and signature, checks the request's inputs against the signature (naming the alias,
the expected dtype and shape, and what came), turns the signature run into a run by tensor names and hands it to
the RunHandler, which runs it through the version's GraphExecutor. It knows NumPy arrays, not protobufs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from servex.executor import GraphExecutor, RunHandler, client_graph_key
from servex.executor.memory import MEMORY
from servex.executor.run_handler import Ticket
from servex.loader.errors import FailedPrecondition, InvalidArgument, ServingError
from servex.loader.manager import ModelManager, ServedVersion
from servex.loader.saved_model import Signature, TensorSpec, dtype_name, shape_matches, shape_text

DEFAULT_SIGNATURE = "serving_default"
MAX_GRAPH_LABELS = 64  # distinct graph-name metric labels per model


class Lease:
    """A request's hold on a served version, from acquire until the work that uses the version is over.

    The request's ``finally`` calls ``end()``. Work handed off first (a run queued on the RunHandler through
    ``hand_off()``'s callback, or a restore awaited with ``wait``) ends the lease itself when it completes, so a
    caller that is cancelled (its client went away) never lets the version unload under a graph still running.
    Used on the event loop's thread only; the hand-off callback may run on any thread.
    """

    __slots__ = ("served", "_manager", "_owned")

    def __init__(self, manager: ModelManager, served: ServedVersion[GraphExecutor]):
        self.served = served
        self._manager = manager
        self._owned = True

    def hand_off(self):
        """Pass the lease to work that will call the returned function once when it is over."""
        if not self._owned:
            raise RuntimeError("the lease was already handed off or ended")
        self._owned = False
        return functools.partial(self._manager.release, self.served)

    async def wait(self, pending: concurrent.futures.Future):
        """Await work running off the loop (not cancelled with the caller) and return its result; if the caller is
        cancelled meanwhile, the lease ends when that work does."""
        try:
            return await asyncio.shield(asyncio.wrap_future(pending))
        except asyncio.CancelledError:
            if self._owned:
                release = self.hand_off()
                pending.add_done_callback(lambda _f: release())
            raise

    def end(self) -> None:
        if self._owned:
            self._owned = False
            self._manager.release(self.served)


class RequestInfo:
    """What the protocol adapter knows of the current call (its priority and deadline) and what the core learns
    (the version and signature that ran), shared through a context variable for scheduling and metrics. A sampled
    call also carries its trace (server/observability/tracing.py), which the adapters' decode and encode times
    add their spans to."""

    __slots__ = ("priority", "deadline", "version", "signature", "_compute_input", "_compute_output", "answer_bytes",
                 "trace", "memory")  # fmt: skip

    def __init__(self, priority: int = 0, deadline: float | None = None):
        self.priority = priority
        self.deadline = deadline  # time.monotonic() by which the run must start, or None
        self.version = ""
        self.signature = ""
        self._compute_input = 0.0
        self._compute_output = 0.0
        self.answer_bytes: int | None = None  # an upper bound on the answer's size, when the adapter knows one
        self.trace = None  # a RequestTrace when this call is traced
        self.memory = 0  # bytes admitted for its runs (executor/memory.py), given back when the call ends

    @property
    def compute_input(self) -> float:
        """Seconds the adapter took to decode the request's tensors (0: not timed), set when decoding ends."""
        return self._compute_input

    @compute_input.setter
    def compute_input(self, seconds: float) -> None:
        self._compute_input = seconds
        if self.trace is not None:
            now = time.perf_counter()
            self.trace.add("decode", now - seconds, now)

    @property
    def compute_output(self) -> float:
        """Seconds the adapter took to encode the answer's tensors, set when encoding ends."""
        return self._compute_output

    @compute_output.setter
    def compute_output(self, seconds: float) -> None:
        self._compute_output = seconds
        if self.trace is not None:
            now = time.perf_counter()
            self.trace.add("encode", now - seconds, now)


MIN_PRIORITY, MAX_PRIORITY = -100, 100  # bounded: priorities are scheduler levels and metric label values


def priority_from_text(text: str, source: str) -> int:
    """A priority sent as text (gRPC metadata, an HTTP header); INVALID_ARGUMENT naming ``source`` and the range."""
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(
            f"{source} must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {text!r}"
        ) from None
    return checked_priority(value, source)


def checked_priority(value: int, source: str) -> int:
    """A request's priority from ``source`` (metadata, a field, a parameter); INVALID_ARGUMENT outside the range."""
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidArgument(f"{source} must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {value}")
    return value


# Set per call by the adapters (gRPC metadata x-servex-priority, the Run request's field, the call's deadline);
# every run the core submits carries it to the RunHandler.
REQUEST: contextvars.ContextVar[RequestInfo] = contextvars.ContextVar("servex_request")


class PredictResult(NamedTuple):
    model_name: str
    version: int
    signature_name: str
    outputs: dict[str, np.ndarray]


class ServingCore:
    def __init__(
        self,
        manager: ModelManager[GraphExecutor],
        run_handler: RunHandler,
        pin_signature_graphs: bool = True,
        max_tensor_bytes: int | None = None,
    ):
        self.manager = manager
        self.run_handler = run_handler
        self.pin_signature_graphs = pin_signature_graphs
        # The most bytes one decoded input tensor may hold (--max_message_bytes), for adapters that read tensors from
        # elsewhere than the request (KServe v2's shared memory); None: no bound.
        self.max_tensor_bytes = max_tensor_bytes
        self._graph_labels: dict[str, set[str]] = {}
        # Set once the models of the start-up config have loaded (or failed): the ports serve before that.
        self.started = False
        self.strict_readiness = False  # ready only while every configured model serves (see ready)

    def ready(self) -> bool:
        """The server's readiness (KServe v2 ServerReady, /v2/health/ready): the start-up loads are over, as gRPC
        health's SERVING says, and a model serves. A model or version that fails later does not make the server
        unready (Triton's --strict-readiness=false); each model's own readiness is exact. With
        ``strict_readiness`` (Triton's default, servex's with a Triton model repository), every configured model
        must serve and none may have a version loading or failed, as Triton's every version READY (a repository
        model whose config.pbtxt cannot be read is not configured: it is logged, and a served one keeps serving)."""
        if not self.started:
            return False
        available = self.manager.available_models()
        if self.strict_readiness:  # no model at all (explicit model control, none loaded yet) is ready, as in Triton
            return len(available) == len(self.manager.model_names()) and not self.manager.failed_models()
        return bool(available)

    # -- resolution ------------------------------------------------------------------------------------

    def resolve(self, name: str, version: int | None = None, label: str = "") -> ServedVersion[GraphExecutor]:
        """The version a request names, without a lease: for answers that do not run the model."""
        if not name:
            raise InvalidArgument("model_spec.name is empty: name the model to call")
        return self.manager.get(name, version, label)

    def acquire(self, name: str, version: int | None = None, label: str = "") -> ServedVersion[GraphExecutor]:
        """Lease the version a request names for one run; pair with ``release``."""
        if not name:
            raise InvalidArgument("model_spec.name is empty: name the model to call")
        return self.manager.acquire(name, version, label)

    def release(self, served: ServedVersion[GraphExecutor]) -> None:
        self.manager.release(served)

    def lease(self, name: str, version: int | None = None, label: str = "") -> Lease:
        """Lease the version a request names until the work that uses it ends; pair with ``Lease.end``. The
        call's metrics and statistics name that version from here on, whatever happens next."""
        lease = Lease(self.manager, self.acquire(name, version, label))
        info = REQUEST.get(None)
        if info is not None:
            info.version = str(lease.served.version)
        return lease

    @staticmethod
    def ticket(lease: Lease, what: str) -> Ticket:
        """The RunHandler ticket of a run under ``lease``; the lease passes to the run handler, which ends it when
        the run is over (or dropped)."""
        info = REQUEST.get(None) or RequestInfo()
        served = lease.served
        info.version, info.signature = str(served.version), what
        labels = (served.name, info.version, what)
        return Ticket(info.priority, info.deadline, served.name, labels, lease.hand_off(), info.trace)

    def run_signature_tensors(
        self, lease: Lease, feeds: Mapping[str, np.ndarray], fetches: Sequence[str], signature_name: str = ""
    ) -> Awaitable[list[np.ndarray]]:
        """One run of a leased version by tensor names, as signature runs go: batchable with compatible
        requests, its client graph pinned when configured. Returns what to await: the run's future when the
        client graph is ready (the usual case: no coroutine of its own), else a coroutine that prepares it first."""
        pending = lease.served.servable.prepare(tuple(feeds), fetches, (), "", self.pin_signature_graphs)
        if pending is not None:
            return self._run_when_prepared(lease, pending, feeds, fetches, signature_name)
        return self._submit_batchable(lease, feeds, fetches, signature_name)

    async def _run_when_prepared(self, lease: Lease, pending, feeds, fetches, signature_name: str):
        await _prepare(lease, pending)
        return await self._submit_batchable(lease, feeds, fetches, signature_name)

    def _submit_batchable(self, lease: Lease, feeds, fetches, signature_name: str):
        graph = admit_run(lease.served, feeds, fetches) if MEMORY.limit else None
        future = self.run_handler.submit_batchable(
            lease.served.servable, dict(feeds), fetches, self.pin_signature_graphs, self.ticket(lease, signature_name)
        )
        if graph is not None:
            future.add_done_callback(functools.partial(_learn, graph, feeds))
        return future

    @staticmethod
    async def _prepared(lease: Lease, feeds, fetches, targets, graph_name: str, pin: bool) -> None:
        """Build the client graph and restore its variables off the run workers (lazy restoration), so that a
        first run that must read a large table never holds a worker that ready graphs could use."""
        pending = lease.served.servable.prepare(tuple(feeds), fetches, targets, graph_name, pin)
        if pending is not None:
            await _prepare(lease, pending)

    def is_served(self, name: str) -> bool:
        return self.manager.is_served(name)

    @staticmethod
    def signature(served: ServedVersion[GraphExecutor], name: str) -> Signature:
        signatures = served.servable.model.signatures
        sig = signatures.get(name or DEFAULT_SIGNATURE)
        if sig is None:  # TensorFlow Serving answers FAILED_PRECONDITION here too
            raise FailedPrecondition(
                f"model {served.name!r} version {served.version} has no signature {name or DEFAULT_SIGNATURE!r}; "
                f"available signatures: {', '.join(sorted(signatures)) or 'none'}"
            )
        return sig

    # -- predict ---------------------------------------------------------------------------------------

    async def predict(
        self,
        name: str,
        version: int | None,
        label: str,
        signature_name: str,
        inputs: Mapping[str, np.ndarray],
        output_filter: Sequence[str] = (),
        output_filter_field: str = "output_filter",
    ) -> PredictResult:
        lease = self.lease(name, version, label)  # the version cannot unload under this run
        served = lease.served
        try:
            sig = self.signature(served, signature_name)
            feeds = self._feeds(served, sig, inputs)
            aliases, fetches = self._fetches(served, sig, output_filter, output_filter_field)
            try:
                values = await self.run_signature_tensors(lease, feeds, fetches, sig.name)
            except ServingError as e:  # the run's own (TensorFlow's, the queue's): say which model it was
                raise e.within(self._where(served, sig)) from e
        finally:
            lease.end()
        return PredictResult(served.name, served.version, sig.name, dict(zip(aliases, values, strict=True)))

    # -- runs by tensor name (SessionRun, servex.v1 GraphExecutor.Run) ---------------------------------

    async def run_graph(
        self,
        name: str,
        version: int | None,
        label: str,
        feeds: Mapping[str, np.ndarray],
        fetches: Sequence[str],
        targets: Sequence[str] = (),
        *,
        graph_name: str = "",
        aliases_of: str | None = None,
    ) -> GraphRunResult:
        """Run by tensor names; with ``aliases_of`` (a signature name), feed and fetch names are that
        signature's aliases, resolved to tensor names as TensorFlow Serving's SessionRun does."""
        if not name:
            raise InvalidArgument("model_spec.name is empty: name the model to call")
        lease = self.lease(name, version, label)
        served = lease.served
        try:
            if aliases_of is not None:
                sig = self.signature(served, aliases_of)
                feeds = {self._alias(served, sig, a, sig.inputs, "input"): v for a, v in feeds.items()}
                fetches = [self._alias(served, sig, a, sig.outputs, "output") for a in fetches]
            executor = served.servable
            try:
                await self._prepared(lease, feeds, fetches, targets, graph_name, False)
                graph = admit_run(served, feeds, (*fetches, *targets, graph_name)) if MEMORY.limit else None
                ticket = self.ticket(lease, self._graph_label(served.name, graph_name))
                values = await self.run_handler.submit(
                    executor.run, feeds, fetches, targets, graph_name, ticket=ticket, inputs=feeds
                )
                if graph is not None:
                    MEMORY.learn(graph, feeds.values(), values)
            except ServingError as e:  # the client graph's build or the run: say which model it was
                raise e.within(f"model {served.name!r} version {served.version}") from e
            key = client_graph_key(feeds, fetches, targets)
        finally:
            lease.end()
        return GraphRunResult(served.name, served.version, values, key)

    def _graph_label(self, model: str, graph_name: str) -> str:
        """The metrics label of a run by tensor names: its graph name, for the first ``MAX_GRAPH_LABELS`` names
        of a model; callers choose graph names, so beyond that they share ``_other`` (bounded series)."""
        if not graph_name:
            return "_graph"
        seen = self._graph_labels.setdefault(model, set())
        if graph_name in seen:
            return graph_name
        if len(seen) < MAX_GRAPH_LABELS:
            seen.add(graph_name)
            return graph_name
        return "_other"

    def _alias(self, served, sig: Signature, alias: str, specs: Mapping[str, TensorSpec], kind: str) -> str:
        spec = specs.get(alias)
        if spec is None:
            raise InvalidArgument(
                f"{self._where(served, sig)}: {alias!r} is not an {kind} alias of the signature; "
                f"{kind}s: {', '.join(sorted(specs)) or 'none'}"
            )
        return spec.name

    @staticmethod
    def _where(served: ServedVersion, sig: Signature) -> str:
        return f"model {served.name!r} version {served.version} signature {sig.name!r}"

    def _feeds(self, served, sig: Signature, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        specs = sig.inputs
        if inputs.keys() != specs.keys():
            missing = sorted(specs.keys() - inputs.keys() - sig.defaults.keys())
            unknown = sorted(inputs.keys() - specs.keys())
            if missing or unknown:
                expected = ", ".join(
                    f"{a} ({s.describe()}{', optional' if a in sig.defaults else ''})" for a, s in sorted(specs.items())
                )
                parts = ([f"missing input(s) {missing}"] if missing else []) + (
                    [f"unknown input(s) {unknown}"] if unknown else []
                )
                raise InvalidArgument(
                    f"{self._where(served, sig)}: {'; '.join(parts)}; expected inputs: {expected or 'none'}"
                )
            # Inputs left out take the signature's defaults, as in TensorFlow Serving.
            inputs = {**{a: v for a, v in sig.defaults.items() if a not in inputs}, **inputs}
        feeds = {}
        for alias, value in inputs.items():
            spec = specs[alias]
            if value.dtype != spec.dtype or not shape_matches(spec.shape, value.shape):
                raise _input_mismatch(self._where(served, sig), alias, spec, value)
            feeds[spec.name] = value
        return feeds

    def _fetches(
        self, served, sig: Signature, output_filter: Sequence[str], field: str
    ) -> tuple[Sequence[str], Sequence[str]]:
        """The outputs to answer (all, or those the request's ``field`` names, checked)."""
        if not output_filter:
            return sig.output_aliases, sig.output_names
        if len(set(output_filter)) != len(output_filter):
            raise InvalidArgument(f"{self._where(served, sig)}: {field} names an output twice: {list(output_filter)}")
        unknown = [a for a in output_filter if a not in sig.outputs]
        if unknown:
            raise InvalidArgument(
                f"{self._where(served, sig)}: {field} names unknown output(s) {unknown}; "
                f"outputs are: {', '.join(sig.output_aliases)}"
            )
        return output_filter, [sig.outputs[a].name for a in output_filter]


async def _prepare(lease: Lease, pending) -> None:
    """Wait for a client graph's build and its variables' restore (lazy restoration); a traced call gets a
    ``build`` span for the wait, saying how many variables it waited for."""
    info = REQUEST.get(None)
    trace = info.trace if info is not None else None
    started = time.perf_counter()
    attributes = {"servex.client_graph.cache": "build"}
    try:
        attributes["servex.variables.restored"] = await lease.wait(pending)
    finally:
        if trace is not None:
            trace.add("build", started, time.perf_counter(), attributes)


def admit_run(served: ServedVersion, feeds: Mapping[str, np.ndarray], fetches: Sequence[str]) -> tuple | None:
    """Admit a run against the memory limit (executor/memory.py) for the current call, which gives it back when it
    ends; returns the key its outputs' size is learned under (None: not a call's run, as a warm-up's)."""
    info = REQUEST.get(None)
    if info is None:
        return None
    graph = (id(served.servable), tuple(feeds), tuple(fetches))
    need = MEMORY.run_need(graph, feeds.values(), lambda: _declared_row_bytes(served, fetches))
    info.memory += MEMORY.admit(need, "run", f"a run of model {served.name!r} version {served.version}")
    return graph


def _declared_row_bytes(served: ServedVersion, fetches: Sequence[str]) -> float:
    """The bytes per row of ``fetches`` (tensor names) that the version's signatures declare (dimensions after the
    first all known), 0 when one is not declared so; for a run's admission before its first run is seen."""
    declared = {s.name: s for sig in served.servable.model.signatures.values() for s in sig.outputs.values()}
    total = 0
    for name in fetches:
        spec = declared.get(name)
        if (
            spec is None
            or spec.shape is None
            or spec.dtype.kind in "SUO"
            or any(d is None or d < 0 for d in spec.shape[1:])
        ):
            return 0
        total += int(np.prod(spec.shape[1:], dtype=np.int64)) * spec.dtype.itemsize
    return total


def _learn(graph: tuple, feeds: Mapping[str, np.ndarray], future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        MEMORY.learn(graph, feeds.values(), future.result())


@dataclass(frozen=True)
class GraphRunResult:
    model_name: str
    version: int
    outputs: list[np.ndarray]  # in fetch order
    client_graph_key: str


def _input_mismatch(where: str, alias: str, spec: TensorSpec, value: np.ndarray) -> InvalidArgument:
    if value.dtype != spec.dtype:
        return InvalidArgument(
            f"{where}: input {alias!r} expects dtype {spec.describe()}, got {dtype_name(value.dtype)} "
            f"shape {list(value.shape)}"
        )
    return InvalidArgument(f"{where}: input {alias!r} expects shape {shape_text(spec.shape)}, got {list(value.shape)}")
