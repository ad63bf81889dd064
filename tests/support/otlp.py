"""An OpenTelemetry collector's trace receiver in the test process: OTLP/gRPC ``TraceService.Export`` (from
opentelemetry-proto) on a free loopback port, keeping every span it is sent."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.support.ports import free_port


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list = []  # opentelemetry.proto.trace.v1.Span, with .resource set to its resource's attributes
        self.resources: list[dict] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                self.resources.append(resource)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout: float = 30.0) -> list:
        """The spans once ``predicate(spans)`` holds; AssertionError with what came after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the spans received did not do: {[s.name for s in spans]}")
            time.sleep(0.05)


def attributes(values) -> dict:
    """OTLP KeyValues as a dict of plain values."""
    out = {}
    for kv in values:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


@contextlib.contextmanager
def receiver() -> Iterator[tuple[Receiver, int]]:
    """A running receiver and its port."""
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield collector, port
    finally:
        server.stop(0)
