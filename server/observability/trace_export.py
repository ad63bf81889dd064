"""Where traces go: OpenTelemetry over OTLP/gRPC (``--trace_config mode=opentelemetry``), or a JSON file in
Triton's trace format (mode ``triton``, ``--trace_config triton,file=PATH``).

OpenTelemetry is configured by ``--trace_config opentelemetry,...`` (``url``: the collector's OTLP/gRPC endpoint,
``resource``, the batch span processor's ``bsp_*``) and, where those are not given, by the standard ``OTEL_*``
environment variables the SDK reads (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``/``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``). The SDK is imported
only in this mode.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from urllib.parse import urlsplit

from servex.server.observability.trace_settings import TraceConfig

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
# Triton's timestamps, from servex's spans: (span, which end, Triton's name)
TRITON_TIMESTAMPS = (
    ("queue", 0, "QUEUE_START"),
    ("run", 0, "COMPUTE_START"),
    ("transfer", 1, "COMPUTE_INPUT_END"),
    ("run", 1, "COMPUTE_OUTPUT_START"),
    ("run", 1, "COMPUTE_END"),
)


def make_exporter(config: TraceConfig):
    if config.mode == "opentelemetry":
        return OpenTelemetryExporter(config)
    return TritonFileExporter(config.file)


def otlp_endpoint(url: str) -> tuple[str, bool]:
    """``--trace_config opentelemetry,url=...`` as the OTLP/gRPC exporter's (endpoint, insecure): ``host:port``
    or ``http://host:port`` is plaintext, ``https://`` is TLS. A URL with a path (OTLP/HTTP's ``/v1/traces``) is
    refused: servex exports over gRPC (port 4317 by convention)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--trace_config opentelemetry,url={url!r}: expected HOST:PORT or http(s)://HOST:PORT")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"--trace_config opentelemetry,url={url!r}: servex sends OTLP over gRPC, which has no path; give the "
            f"collector's gRPC endpoint (HOST:4317 by convention), not an OTLP/HTTP URL"
        )
    return parts.netloc, parts.scheme == "http"


class OpenTelemetryExporter:
    def __init__(self, config: TraceConfig):
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attributes = dict(config.resource)
        if "service.name" not in attributes and not _service_named_by_environment():
            attributes["service.name"] = "servex"
        url = config.opentelemetry.get("url")
        if url:
            endpoint, insecure = otlp_endpoint(url)
            span_exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        else:
            span_exporter = OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else localhost:4317
        batching = {
            "max_queue_size": config.opentelemetry.get("bsp_max_queue_size"),
            "schedule_delay_millis": config.opentelemetry.get("bsp_schedule_delay"),
            "max_export_batch_size": config.opentelemetry.get("bsp_max_export_batch_size"),
        }
        self.processor = BatchSpanProcessor(span_exporter, **{k: int(v) for k, v in batching.items() if v is not None})
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("servex")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = trace.SpanKind.SERVER
        self._link = trace.Link
        self._span_context = trace.SpanContext
        self._readable = ReadableSpan
        self._scope = InstrumentationScope("servex")
        self._sampled = trace.TraceFlags(trace.TraceFlags.SAMPLED | trace.TraceFlags.RANDOM_TRACE_ID)
        self.pending = 0

    def parent(self, headers) -> tuple[object, bool]:
        """The caller's trace context from its ``traceparent`` (and ``tracestate``), and whether it is sampled."""
        carrier = {k.lower(): v for k, v in headers() if k.lower() in (TRACEPARENT, "tracestate")}
        if TRACEPARENT not in carrier:
            return None, False
        context = self._propagator.extract(carrier)
        span_context = self._trace.get_current_span(context).get_span_context()
        return context, span_context.is_valid and span_context.trace_flags.sampled

    def batch_span(self, trace, start: float, end: float, size: int, requests: int):
        """The batch's own span (a root: the requests it ran link to it), if the sampler takes it."""
        ids, attributes = self.tracer.id_generator, {"servex.batch.size": size, "servex.batch.requests": requests}
        trace_id = ids.generate_trace_id()
        sampling = self.tracer.sampler.should_sample(None, trace_id, "batch", attributes=attributes)
        if not sampling.decision.is_sampled():
            return None
        context = self._span_context(trace_id, ids.generate_span_id(), False, self._sampled, sampling.trace_state)
        self._end("batch", context, None, trace.ns(start), trace.ns(end), attributes, ())
        return context

    def export(self, trace, code: str, start: float, end: float) -> None:
        """The request span through the SDK's tracer (its sampler decides, as ``OTEL_TRACES_SAMPLER`` says), and
        its children as finished spans straight to the batch span processor: the stages' times are known, and the
        tracer's start/end machinery (context, sampler, locks, bounded attributes: about 50 µs a span) would make
        tracing cost several times what the call it traces does."""
        attributes = {"servex.method": trace.method, "model_name": trace.model, "servex.status_code": code,
                      "rpc.system": "http" if trace.method.startswith("rest:") else "grpc"}  # fmt: skip
        if trace.version:
            attributes["model_version"] = trace.version
        root = self.tracer.start_span(
            trace.method,
            context=trace.parent,
            kind=self._server_kind,
            start_time=trace.ns(start),
            attributes=attributes,
        )
        if root.is_recording():
            parent = root.get_span_context()
            ids, trace_id, flags = self.tracer.id_generator, parent.trace_id, parent.trace_flags
            for name, s, e, attrs, link in list(trace.spans):
                context = self._span_context(trace_id, ids.generate_span_id(), False, flags, parent.trace_state)
                links = (self._link(link),) if link is not None else ()
                self._end(name, context, parent, trace.ns(s), trace.ns(e), attrs, links)
            if code != "OK":
                root.set_status(self._trace.Status(self._trace.StatusCode.ERROR, code))
        root.end(end_time=trace.ns(end))
        context = root.get_span_context()
        if context.trace_flags.sampled:
            trace.trace_id = format(context.trace_id, "032x")

    def _end(self, name: str, context, parent, start: int, end: int, attributes, links) -> None:
        span = self._readable(name, context, parent, self.provider.resource, attributes, (), links,
                              start_time=start, end_time=end, instrumentation_scope=self._scope)  # fmt: skip
        self.processor.on_end(span)

    def flush(self, indexed: bool = True) -> None:
        self.provider.force_flush()

    def close(self) -> None:
        self.provider.shutdown()


def _service_named_by_environment() -> bool:
    return bool(os.environ.get("OTEL_SERVICE_NAME")) or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )


class TritonFileExporter:
    """Triton's JSON trace file: per trace, ``{"id", "model_name", "model_version", "request_id", "parent_id"}``
    then ``{"id", "timestamps": [{"name", "ns"}]}``. Written to ``FILE.<index>`` every ``log_frequency`` traces
    or when ``trace_count`` runs out, and what is left to ``FILE`` (or the next index) at exit. Without a file,
    traces are counted and dropped."""

    def __init__(self, path: str):
        self.path = path
        self.records: list[dict] = []
        self.pending = 0
        self.index = 0
        self._next_id = 1
        self._lock = threading.Lock()

    @staticmethod
    def parent(headers) -> tuple[None, bool]:
        return None, False

    @staticmethod
    def batch_span(trace, start: float, end: float, size: int, requests: int) -> None:
        return None

    def export(self, trace, code: str, start: float, end: float) -> None:
        stamps = [("REQUEST_START", start)]
        spans = {name: (s, e) for name, s, e, _, _ in list(trace.spans)}
        stamps += [(label, spans[name][end_]) for name, end_, label in TRITON_TIMESTAMPS if name in spans]
        stamps.append(("REQUEST_END", end))
        with self._lock:
            trace_id, self._next_id = self._next_id, self._next_id + 1
            version = int(trace.version) if trace.version.isdigit() else -1
            self.records.append({"id": trace_id, "model_name": trace.model, "model_version": version,
                                 "request_id": "", "parent_id": 0})  # fmt: skip
            self.records.append({"id": trace_id, "timestamps": [{"name": n, "ns": trace.ns(t)} for n, t in stamps]})
            self.pending += 1
        trace.trace_id = str(trace_id)

    def flush(self, indexed: bool = True) -> None:
        with self._lock:
            records, self.records, self.pending = self.records, [], 0
            if not records or not self.path:
                return
            path = f"{self.path}.{self.index}" if indexed else self.path
            self.index += indexed
        try:
            with open(path, "w") as f:
                json.dump(records, f)
        except OSError as e:
            log.error("could not write the trace file %s: %s", path, e)

    def close(self) -> None:
        self.flush(indexed=self.index > 0)
