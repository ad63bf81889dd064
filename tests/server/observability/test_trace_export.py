"""The OpenTelemetry exporter on its own, sending to a real OTLP/gRPC receiver: the request span through the SDK's
tracer, its children and the batch's span as finished spans, all in one trace (the batch in its own, linked), and
the SDK's sampler still deciding (``OTEL_TRACES_SAMPLER``)."""

from __future__ import annotations

import time

import pytest

from servex.server.observability.trace_export import OpenTelemetryExporter
from servex.server.observability.trace_settings import parse_trace_config
from servex.server.observability.tracing import RequestTrace
from tests.support.otlp import attributes, receiver


def _exporter(port: int) -> OpenTelemetryExporter:
    return OpenTelemetryExporter(
        parse_trace_config(["mode=opentelemetry", f"opentelemetry,url=127.0.0.1:{port}", "level=TIMESTAMPS"])
    )


def _traced_call(exporter: OpenTelemetryExporter, code: str = "OK") -> RequestTrace:
    trace = RequestTrace(exporter, "ModelInfer", "mlp", None)
    trace.version = "3"
    t = time.perf_counter()
    trace.add("decode", t, t + 0.001)
    trace.add("queue", t + 0.001, t + 0.002)
    link = trace.batch(t + 0.002, t + 0.004, 4, 2)
    trace.add("batch", t + 0.002, t + 0.004, {"servex.batch.size": 4, "servex.batch.requests": 2}, link)
    trace.add("run", t + 0.002, t + 0.004, {"servex.client_graph": "x:0^y:0^", "servex.cache": "hit"})
    trace.add("encode", t + 0.004, t + 0.005)
    exporter.export(trace, code, t, t + 0.006)
    return trace


def test_a_traced_call_gives_its_request_span_children_and_a_linked_batch_span():
    with receiver() as (collector, port):
        exporter = _exporter(port)
        try:
            trace = _traced_call(exporter, code="INVALID_ARGUMENT")
            exporter.flush()
            spans = collector.wait_for(lambda spans: len(spans) == 7)
        finally:
            exporter.close()
    root = next(s for s in spans if s.name == "ModelInfer")
    by_name = {s.name: s for s in spans if s.trace_id == root.trace_id}
    assert root.trace_id.hex() == trace.trace_id and not root.parent_span_id
    assert attributes(root.attributes) == {
        "servex.method": "ModelInfer", "model_name": "mlp", "servex.status_code": "INVALID_ARGUMENT",
        "rpc.system": "grpc", "model_version": "3",
    }  # fmt: skip
    assert root.status.code == root.status.STATUS_CODE_ERROR and root.kind == root.SPAN_KIND_SERVER
    children = [s for s in by_name.values() if s is not root]
    assert sorted(s.name for s in children) == ["batch", "decode", "encode", "queue", "run"]
    assert len({s.span_id for s in spans}) == 7
    for child in children:
        assert child.trace_id == root.trace_id and child.parent_span_id == root.span_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano < child.end_time_unix_nano
        assert child.end_time_unix_nano <= root.end_time_unix_nano
    assert attributes(by_name["run"].attributes)["servex.client_graph"] == "x:0^y:0^"
    # the batch's own span: another trace, which the request's batch span links to
    (batch,) = [s for s in spans if s.name == "batch" and s.trace_id != root.trace_id]
    assert attributes(batch.attributes) == {"servex.batch.size": 4, "servex.batch.requests": 2}
    (link,) = by_name["batch"].links
    assert (link.trace_id, link.span_id) == (batch.trace_id, batch.span_id)


def test_the_sdks_sampler_still_decides(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    with receiver() as (collector, port):
        exporter = _exporter(port)
        try:
            trace = _traced_call(exporter)
            exporter.flush()
            time.sleep(0.5)
        finally:
            exporter.close()
    assert collector.spans == [] and trace.trace_id == ""


@pytest.mark.parametrize("rest", [False, True])
def test_the_request_span_names_its_protocol(rest):
    with receiver() as (collector, port):
        exporter = _exporter(port)
        try:
            trace = RequestTrace(exporter, "rest:predict" if rest else "Predict", "mlp", None)
            t = time.perf_counter()
            exporter.export(trace, "OK", t, t + 0.001)
            exporter.flush()
            (span,) = collector.wait_for(lambda spans: len(spans) == 1)
        finally:
            exporter.close()
    assert attributes(span.attributes)["rpc.system"] == ("http" if rest else "grpc")
    assert "model_version" not in attributes(span.attributes)
