"""Request tracing: where one request's time went (decode, queue, batch, transfer, run, encode), as OpenTelemetry
spans sent over OTLP, or as a JSON trace file in Triton's format.

Off by default, and then a request pays one attribute read (``TRACER.enabled``). When Triton's trace settings
(server/observability/trace_settings.py: ``--trace_config``, or the trace extension at run time) turn a level on,
each request asks the settings whether it is sampled (one of every ``trace_rate``, or its caller's W3C
``traceparent`` says sampled); a sampled request carries a ``RequestTrace`` on its RequestInfo and its run
handler Ticket, and each stage appends its span's times to it (perf_counter / monotonic seconds: one clock on
Linux). The spans are made when the call is answered (``finish``), off the stages' way: OpenTelemetry's SDK
with explicit start and end times and its batch span processor, or Triton's JSON records.

The request span continues the caller's trace (``traceparent`` in gRPC metadata or HTTP headers), and its
children are ``decode``, ``build`` (a client graph built or variables restored for this request), ``queue``,
``batch`` (linked to the batch's own span, which holds the batch size), ``transfer`` (host to device), ``run``
(client graph key, graph name, cache hit or build, variables restored for it) and ``encode``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from servex.server.observability.trace_settings import TraceConfig, TraceSettings

log = logging.getLogger(__name__)

Span = tuple  # (name, start, end, attributes or None, link or None): times in perf_counter seconds


# The calls traced, as Triton traces inferences: those that run a model (gRPC methods and REST calls by servex's
# metric names). TensorFlow Serving's REST calls are named once their URL is read ("rest:malformed" until then).
TRACED_METHODS = frozenset({"Predict", "Classify", "Regress", "MultiInference", "SessionRun", "ModelInfer", "Run",
                            "rest:predict", "rest:classify", "rest:regress", "rest:v2_infer"})  # fmt: skip
_STARTS = TRACED_METHODS | {"rest:malformed"}


class RequestTrace:
    """One sampled request's spans, appended by each stage (any thread; list.append is atomic)."""

    __slots__ = ("exporter", "method", "model", "parent", "spans", "wall0", "clock0", "trace_id", "version", "ended")

    def __init__(self, exporter, method: str, model: str, parent):
        self.exporter = exporter
        self.method = method
        self.model = model
        self.parent = parent  # the caller's context (OpenTelemetry), or None
        self.spans: list[Span] = []
        self.wall0 = time.time_ns()
        self.clock0 = time.perf_counter()
        self.trace_id = ""  # hex, once exported
        self.version = ""
        self.ended = False

    def add(self, name: str, start: float, end: float, attributes: dict | None = None, link=None) -> None:
        self.spans.append((name, start, end, attributes, link))

    def ns(self, clock: float) -> int:
        """A perf_counter (or monotonic) time as Unix nanoseconds."""
        return self.wall0 + int((clock - self.clock0) * 1e9)

    def batch(self, start: float, end: float, size: int, requests: int):
        """The batch this request ran in: its span (made once per batch by the first traced request's worker
        call, shared by the others through the returned link)."""
        return self.exporter.batch_span(self, start, end, size, requests)


class Tracer:
    """The process's tracer: settings, the exporter, and the one flag the request path reads."""

    def __init__(self, settings: TraceSettings | None = None, exporter=None):
        self.settings = settings or TraceSettings()
        self.exporter = exporter
        self.enabled = False
        self.refresh()

    def refresh(self) -> None:
        """Read again whether any level is on (after a settings change)."""
        self.enabled = self.exporter is not None and self.settings.any_on()

    def update(self, model: str, changes: dict[str, list[str]]) -> dict[str, list[str]]:
        """Triton's trace extension: change and read the settings of ``model`` (or the global ones)."""
        settings = self.settings.update(model, changes)
        self.refresh()
        return settings

    def start(self, method: str, model: str, headers: Callable[[], Iterable[tuple[str, str]]]) -> RequestTrace | None:
        """A RequestTrace when this request of ``model`` is sampled, else None; ``headers`` gives the call's
        metadata or HTTP headers (read only when tracing is on)."""
        if method not in _STARTS:
            return None
        exporter = self.exporter
        parent, sampled = exporter.parent(headers)
        if not self.settings.sample(model, sampled):
            return None
        return RequestTrace(exporter, method, model, parent)

    def finish(self, trace: RequestTrace, method: str, code: str, start: float, end: float) -> None:
        """Export ``trace`` of a ``method`` call: the request span from ``start`` to ``end`` (perf_counter) and its
        children (nothing for a call that turned out to run no model: a REST URL that is not an inference)."""
        if trace.ended or method not in TRACED_METHODS:
            return
        trace.ended = True
        trace.method = method
        try:
            self.exporter.export(trace, code, start, end)
        except Exception:  # a trace must never fail the call it describes
            log.exception("could not export the trace of a %s call", trace.method)
        values = self.settings.effective(trace.model)
        frequency = values.log_frequency
        if values.count == 0 or (frequency and self.exporter.pending >= frequency):
            self.exporter.flush()  # Triton writes its file every log_frequency traces, and when the count runs out

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()


TRACER = Tracer()
_configure_lock = threading.Lock()


def configure(config: TraceConfig) -> Tracer:
    """Set the process's tracer up from ``--trace_config`` (the exporter is made even with every level OFF, so
    that the trace extension can turn tracing on later)."""
    from servex.server.observability.trace_export import make_exporter

    with _configure_lock:
        TRACER.close()
        TRACER.settings = TraceSettings(config)
        TRACER.exporter = make_exporter(config)
        TRACER.refresh()
    return TRACER
