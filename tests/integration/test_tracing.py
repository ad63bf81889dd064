"""Request tracing through the real daemon: OpenTelemetry spans sent over OTLP/gRPC to a receiver in the test
(opentelemetry-proto's TraceService), continuing the caller's W3C trace; Triton's trace extension through
tritonclient (gRPC and REST); Triton's JSON trace file; exemplars on the latency histogram."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.conftest import HALF_PLUS_TWO_TF1
from tests.support.daemon import wait_for
from tests.support.otlp import attributes, receiver
from tests.support.paths import REPO

pytestmark = pytest.mark.integration

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def _x(value: float = 2.0) -> list:
    x = triton.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[value]], np.float32))
    return [x]


@pytest.fixture(scope="module")
def otel(start_daemon):
    with receiver() as (collector, port):
        daemon = start_daemon(
            f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=hp", "--trace_config=mode=opentelemetry",
            f"--trace_config=opentelemetry,url=127.0.0.1:{port}", "--trace_config=level=TIMESTAMPS",
            "--trace_config=rate=1", "--trace_config=opentelemetry,bsp_schedule_delay=50",
            "--trace_config=opentelemetry,resource=deployment.environment=test", rest=True,
        )  # fmt: skip
        yield daemon, collector


def _trace_of(collector, trace_id: str, root: str) -> tuple:
    """The root span named ``root`` of trace ``trace_id`` and its children, once they have all come."""

    def complete(spans):
        ours = [s for s in spans if s.trace_id.hex() == trace_id]
        roots = [s for s in ours if s.name == root]
        return roots and {"decode", "queue", "transfer", "run", "encode"} <= {
            s.name for s in ours if s.parent_span_id == roots[0].span_id
        }

    spans = [s for s in collector.wait_for(complete) if s.trace_id.hex() == trace_id]
    (top,) = [s for s in spans if s.name == root]
    return top, {s.name: s for s in spans if s.parent_span_id == top.span_id}


def test_an_inference_continues_the_callers_trace_with_a_span_per_stage(otel):
    """KServe v2 over gRPC with a W3C traceparent: the request span is the caller's span's child, in the caller's
    trace, and has decode, build (the first call builds its client graph), queue, run and encode children in
    order, with the model, version and client graph named."""
    daemon, collector = otel
    client = triton.InferenceServerClient(daemon.address)
    answer = client.infer("hp", _x(), headers={"traceparent": TRACEPARENT})
    np.testing.assert_allclose(answer.as_numpy("y"), [[3.0]])
    top, children = _trace_of(collector, CALLER_TRACE, "ModelInfer")
    assert top.parent_span_id.hex() == CALLER_SPAN
    expected = {"model_name": "hp", "model_version": "123", "servex.status_code": "OK"}
    assert expected.items() <= attributes(top.attributes).items()
    order = sorted(children.values(), key=lambda s: s.start_time_unix_nano)
    names = [s.name for s in order]
    assert names.index("decode") < names.index("queue") < names.index("run") < names.index("encode"), names
    assert children["run"].start_time_unix_nano <= children["transfer"].start_time_unix_nano  # inputs to the device
    assert children["transfer"].end_time_unix_nano <= children["run"].end_time_unix_nano
    for span in order:
        assert (
            top.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano <= top.end_time_unix_nano
        )
    run = attributes(children["run"].attributes)
    assert run["servex.client_graph"] == "x:0^y:0^" and run["servex.batch.size"] == 1
    # the first call's client graph was built for it, and restored the model's two variables (lazy restoration)
    assert run["servex.client_graph.cache"] == "build" and run["servex.variables.restored"] == 2
    assert attributes(children["build"].attributes)["servex.variables.restored"] == 2
    resource = collector.resources[-1]
    assert resource["service.name"] == "servex" and resource["deployment.environment"] == "test"


def test_tensorflow_serving_calls_over_grpc_and_rest_are_traced_and_settings_calls_are_not(otel):
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    daemon, collector = otel
    grpc_trace, rest_trace = "1" * 32, "2" * 32
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "hp"
    request.inputs["x"].CopyFrom(__import__("tensorflow").make_tensor_proto([[1.0]], dtype="float32"))
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    stub.Predict(request, metadata=[("traceparent", f"00-{grpc_trace}-{CALLER_SPAN}-01")], timeout=30)
    body = json.dumps({"instances": [[1.0]]}).encode()
    rest = urllib.request.Request(f"{daemon.rest_url}/v1/models/hp:predict", body,
                                  {"traceparent": f"00-{rest_trace}-{CALLER_SPAN}-01"})  # fmt: skip
    assert json.loads(urllib.request.urlopen(rest, timeout=30).read()) == {"predictions": [[2.5]]}
    triton.InferenceServerClient(daemon.address).get_trace_settings(headers={"traceparent": TRACEPARENT})
    grpc_top, _ = _trace_of(collector, grpc_trace, "Predict")
    rest_top, _ = _trace_of(collector, rest_trace, "rest:predict")
    assert (
        attributes(rest_top.attributes)["rpc.system"] == "http"
        and attributes(grpc_top.attributes)["rpc.system"] == "grpc"
    )
    assert not [s for s in collector.spans if s.name == "TraceSetting"]


def test_the_latency_histogram_carries_trace_ids_as_exemplars_for_openmetrics_scrapers(otel):
    daemon, collector = otel
    trace = "3" * 32
    triton.InferenceServerClient(daemon.address).infer(
        "hp", _x(), headers={"traceparent": f"00-{trace}-{CALLER_SPAN}-01"}
    )
    scrape = urllib.request.Request(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                    headers={"Accept": "application/openmetrics-text; version=1.0.0"})  # fmt: skip
    text = urllib.request.urlopen(scrape, timeout=30).read().decode()
    exemplars = [line for line in text.splitlines()
                 if line.startswith("servex_request_latency_seconds_bucket") and "# {" in line]  # fmt: skip
    assert any(f'trace_id="{trace}"' in line and 'method="ModelInfer"' in line for line in exemplars), exemplars
    dashboard = json.loads((REPO / "deploy" / "grafana" / "servex-dashboard.json").read_text())
    (latency,) = [p for p in dashboard["panels"] if p["title"].startswith("Request latency p50 / p99")]
    assert all(target["exemplar"] for target in latency["targets"])  # Grafana shows them, each linking to its trace


def test_trace_settings_are_read_and_changed_per_model_and_globally_over_grpc_and_rest(start_daemon, tmp_path):
    """Triton's trace extension through tritonclient: global and per model settings, a model's cleared setting
    falling back to the global one, the read-only file and mode, and bad values refused with Triton's words;
    traces in Triton's JSON file, written every log_frequency traces."""
    path = tmp_path / "trace.json"
    flags = (f"--trace-config=triton,file={path}", "--trace-config=triton,log-frequency=2")
    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=hp", *flags, rest=True)
    client = triton.InferenceServerClient(daemon.address)
    rest = triton_http.InferenceServerClient(daemon.rest_url.removeprefix("http://"))
    assert rest.get_trace_settings() == {
        "trace_level": ["OFF"], "trace_rate": ["1000"], "trace_count": ["-1"], "log_frequency": ["2"],
        "trace_file": [str(path)], "trace_mode": ["triton"],
    }  # fmt: skip
    client.update_trace_settings(settings={"trace_rate": "1"})
    updated = client.update_trace_settings(model_name="hp", settings={"trace_level": ["TIMESTAMPS"]}, as_json=True)
    assert updated["settings"]["trace_level"] == {"value": ["TIMESTAMPS"]}
    assert updated["settings"]["trace_rate"] == {"value": ["1"]}  # the global rate: not set on hp
    assert rest.get_trace_settings()["trace_level"] == ["OFF"]  # the global level is untouched
    for value in range(4):
        client.infer("hp", _x(value))
    wait_for(lambda: (tmp_path / "trace.json.1").exists(), 30)
    for index in (0, 1):
        records = json.loads((tmp_path / f"trace.json.{index}").read_text())
        heads = [r for r in records if "model_name" in r]
        assert [h["model_name"] for h in heads] == ["hp", "hp"] and {h["model_version"] for h in heads} == {123}
        for stamps in (r["timestamps"] for r in records if "timestamps" in r):
            names = [s["name"] for s in stamps]
            assert names[0] == "REQUEST_START" and names[-1] == "REQUEST_END" and "COMPUTE_START" in names
            assert [s["ns"] for s in stamps] == sorted(s["ns"] for s in stamps)
    rest.update_trace_settings(model_name="hp", settings={"trace_level": None})  # cleared: the global OFF
    assert client.get_trace_settings(model_name="hp", as_json=True)["settings"]["trace_level"] == {"value": ["OFF"]}
    for settings, says in (({"trace_file": "/tmp/x"}, "can not be updated through network protocol"),
                           ({"trace_rate": "0"}, "out of range [ 1, 4294967295 ]"),
                           ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
                           ({"trace_depth": "3"}, "unknown trace setting 'trace_depth'")):  # fmt: skip
        for update in (client.update_trace_settings, rest.update_trace_settings):
            with pytest.raises(InferenceServerException) as info:
                update(settings=settings)
            assert says in info.value.message(), info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_trace_settings(model_name="nope")
    assert "nope" in info.value.message()
