"""Request metrics and the Prometheus endpoint (prometheus_client's text exposition at /metrics).

Label children are looked up once per kind of call (method, model, version, signature, priority, code) and kept,
so a request pays a dict lookup and an observe, not a label resolution.
"""

from __future__ import annotations

import asyncio
import logging
import os

import prometheus_client
from prometheus_client import Counter, Histogram

from executor.statistics import statistics

log = logging.getLogger(__name__)
prometheus_client.disable_created_metrics()  # the *_created gauges only add series nobody graphs

LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)

LABELS = ["method", "model", "version", "signature", "priority"]
REQUESTS = Counter(
    "servex_requests",
    "Requests answered, by API method, model, version, signature (or graph name), priority and gRPC status code",
    [*LABELS, "code"],
)
REQUEST_LATENCY = Histogram(
    "servex_request_latency_seconds",
    "Time from a request's arrival in its handler to its answer (end to end in the server)",
    LABELS,
    buckets=LATENCY_BUCKETS,
)

# How late the event loop runs a timer, sampled twice a second: long values mean the loop thread was held (a long
# callback, a garbage collection). Calls queued in gRPC core under load do not show here: the loop takes gRPC's
# completions in batches, and its iterations stay short (measured 0.1-0.15 ms at 32 callers on the MLP).
EVENT_LOOP_LAG = Histogram(
    "servex_event_loop_lag_seconds",
    "How late the event loop ran a timer (sampled every 0.5 s): long values mean the loop thread was held",
    buckets=LATENCY_BUCKETS,
)
LAG_INTERVAL_SECONDS = 0.5


async def watch_loop_lag(interval: float = LAG_INTERVAL_SECONDS) -> None:
    """Observe the running loop's lag every ``interval`` seconds, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        EVENT_LOOP_LAG.observe(max(0.0, loop.time() - due))


class CallRecorder:
    """What one kind of answered call updates (method, model, version, signature, priority and code): its
    request counter and latency histogram children, and, for an inference, its version's Triton statistics.
    Looked up once per kind and kept, so a request pays one dict lookup here."""

    __slots__ = ("count", "latency", "stats", "ok")

    def __init__(self, labels: tuple[str, str, str, str, str], code: str):
        self.count = REQUESTS.labels(*labels, code)
        self.latency = REQUEST_LATENCY.labels(*labels)
        version = labels[2]  # set when a run was asked of that version: an inference, in Triton's statistics
        self.stats = statistics(labels[1], version) if version else None
        self.ok = code == "OK"

    def __call__(self, seconds: float, decoding: float, encoding: float) -> None:
        self.count.inc()
        self.latency.observe(seconds)
        if self.stats is not None:
            self.stats.answered(self.ok, seconds, decoding, encoding)


_recorders: dict[tuple, CallRecorder] = {}


def recorder(method: str, model: str, version: str, signature: str, priority: int, code: str) -> CallRecorder:
    """The CallRecorder of one kind of call; ``model`` must be a served model's name or a shared placeholder,
    so that clients cannot grow this cache (or the metrics) with made-up names."""
    key = (method, model, version, signature, priority, code)
    found = _recorders.get(key)
    if found is None:
        found = _recorders[key] = CallRecorder((method, model, version, signature, str(priority)), code)
    return found


# servex's methods that TensorFlow Serving counts and times, as its (API, entrypoint) labels.
TF_SERVING_APIS = {
    "Predict": ("Predict", "GRPC"),
    "Classify": ("Classify", "GRPC"),
    "Regress": ("Regress", "GRPC"),
    "rest:predict": ("Predict", "REST"),
    "rest:classify": ("Classify", "REST"),
    "rest:regress": ("Regress", "REST"),
}


class TFServingNames:
    """TensorFlow Serving's request metrics under its own names, made at scrape time from servex's (``source``, a
    registry), so that dashboards and alerts written for TensorFlow Serving's monitoring endpoint keep working:

    - ``:tensorflow:serving:request_count{model_name, status}``: ``servex_requests_total`` of the Predict,
      Classify and Regress calls (gRPC and REST), by model and status code. Exposed untyped: prometheus_client
      names a counter's samples ``..._total``, and TensorFlow Serving's have no suffix; PromQL treats both alike;
    - ``:tensorflow:serving:request_latency{model_name, API, entrypoint}``: a histogram in microseconds, from
      ``servex_request_latency_seconds`` of the same calls (servex's buckets, scaled; errors included, where
      TensorFlow Serving times successes only).

    Nothing is added on the request path: the figures are servex's own, renamed."""

    def __init__(self, source):
        self.source = source

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily, Metric

        counts: dict[tuple[str, str], float] = {}
        buckets: dict[tuple[str, str, str], dict[str, float]] = {}
        sums: dict[tuple[str, str, str], float] = {}
        for family in self.source.collect():
            if family.name == "servex_requests":
                for sample in family.samples:
                    if sample.name == "servex_requests_total" and sample.labels["method"] in TF_SERVING_APIS:
                        key = (sample.labels["model"], sample.labels["code"])
                        counts[key] = counts.get(key, 0.0) + sample.value
            elif family.name == "servex_request_latency_seconds":
                for sample in family.samples:
                    api = TF_SERVING_APIS.get(sample.labels.get("method", ""))
                    if api is None:
                        continue
                    key = (sample.labels["model"], *api)
                    if sample.name.endswith("_bucket"):
                        cumulative = buckets.setdefault(key, {})
                        cumulative[sample.labels["le"]] = cumulative.get(sample.labels["le"], 0.0) + sample.value
                    elif sample.name.endswith("_sum"):
                        sums[key] = sums.get(key, 0.0) + sample.value
        count = Metric(":tensorflow:serving:request_count", "The total number of requests.", "unknown")
        for (model, status), value in sorted(counts.items()):
            count.add_sample(":tensorflow:serving:request_count", {"model_name": model, "status": status}, value)
        yield count
        latency = HistogramMetricFamily(
            ":tensorflow:serving:request_latency",
            "Distribution of wall time (in microseconds) for Tensorflow Serving request.",
            labels=["model_name", "API", "entrypoint"],
        )
        for key, cumulative in sorted(buckets.items()):
            ordered = sorted(cumulative.items(), key=lambda item: float(item[0]))  # "+Inf" sorts last
            scaled = [(le if le == "+Inf" else repr(round(float(le) * 1e6, 3)), value) for le, value in ordered]
            latency.add_metric(list(key), buckets=scaled, sum_value=sums.get(key, 0.0) * 1e6)
        yield latency


def exposition(tf_serving_names: bool = False) -> tuple[bytes, str]:
    """The Prometheus text exposition of every metric and its content type: this process's, or in a group of
    serving processes (prometheus_client's multiprocess mode) all of theirs; with ``tf_serving_names``,
    TensorFlow Serving's request metrics as well (``TFServingNames``)."""
    registry = prometheus_client.REGISTRY
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir:
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = prometheus_client.CollectorRegistry()
        MultiProcessCollector(registry, path=metrics_dir)
    if tf_serving_names:
        source, registry = registry, prometheus_client.CollectorRegistry()
        registry.register(source)  # a registry is a collector of its metrics
        registry.register(TFServingNames(source))
    return prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST


def start_metrics_server(port: int, address: str):
    """Serve /metrics on ``port``; returns the server (``shutdown()`` stops it)."""
    server, _thread = prometheus_client.start_http_server(port, addr=address)
    log.info("Prometheus metrics on http://%s:%d/metrics", address, port)
    return server


MODEL_LOAD_FAILURES = Counter(
    "servex_model_load_failures", "Version loads that failed (each retry counts), by model", ["model"]
)
MODEL_LOAD_SECONDS = Histogram(
    "servex_model_load_seconds",
    "Time to load a model version that loaded (lazy restoration: variables are read later)",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300),
)


def model_load(name: str, version: int, ok: bool, seconds: float) -> None:
    """ModelManager's on_load hook: count failures, time successes."""
    if ok:
        MODEL_LOAD_SECONDS.labels(name).observe(seconds)
    else:
        MODEL_LOAD_FAILURES.labels(name).inc()
