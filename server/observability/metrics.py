"""Request metrics and the Prometheus endpoint (prometheus_client's text exposition at /metrics).

Label children are looked up once per kind of call (method, model, version, signature, priority, code) and kept,
so a request pays a dict lookup and an observe, not a label resolution.
"""

from __future__ import annotations

import asyncio
import logging
import os

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from servex.executor.statistics import statistics

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

# TLS of the gRPC ports (server/transport/tls.py), labelled by the file the certificate comes from (--ssl_config_file or
# --ssl_server_cert_file); no series without TLS.
TLS_NOT_AFTER = Gauge(
    "servex_tls_certificate_expiry_timestamp_seconds",
    "When the server certificate new TLS connections get expires (its notAfter, Unix time)",
    ["file"],
    multiprocess_mode="livemin",
)
TLS_RELOADS = Counter(
    "servex_tls_certificate_reloads",
    "Changes of the TLS files seen: rotated (new connections get the new certificate), refused (cannot serve: "
    "the certificate in use kept), unreadable (read again a second later)",
    ["file", "outcome"],
)
TLS_OUTCOMES = ("rotated", "refused", "unreadable")

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

    def __call__(self, seconds: float, decoding: float, encoding: float, exemplar: dict | None = None) -> None:
        self.count.inc()
        self.latency.observe(seconds, exemplar)
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
    """TensorFlow Serving's metrics under its own names, made at scrape time from servex's (``source``, a registry),
    so that dashboards and alerts written for TensorFlow Serving's monitoring endpoint keep working. Nothing is
    added on the request path: the figures are servex's own, renamed, regrouped and scaled to microseconds.
    TensorFlow's counters are exposed untyped: prometheus_client names a counter's samples ``..._total``, and
    TensorFlow Serving's have no suffix; PromQL treats both alike. Histograms keep servex's buckets, scaled (TensorFlow
    Serving's are powers of 1.8 from 10 µs; ``histogram_quantile`` works on either, a query naming one of its ``le``
    values does not).

    - ``:tensorflow:serving:request_count{model_name, status}``: ``servex_requests_total`` of the Predict,
      Classify and Regress calls (gRPC and REST), by model and status code;
    - ``:tensorflow:serving:request_latency{model_name, API, entrypoint}``: from ``servex_request_latency_seconds``
      of the same calls (errors included, where TensorFlow Serving times successes only; recent TensorFlow Serving
      also labels it by ``status``, which servex's histogram does not have);
    - ``:tensorflow:serving:runtime_latency{model_name, API, runtime}``: the model runtime's time per request, from
      ``servex_run_seconds`` (the graph run of the request, of its whole batch when batched, as TensorFlow
      Serving's ``Session::Run`` is). ``runtime`` is ``TF1``, as TensorFlow Serving names a ``Session`` (servex
      runs a ``tf.compat.v1.Session``'s callables). servex's histogram is labelled by model, version, signature
      and priority, not by API, so ``API`` comes from ``servex_requests_total``: the methods whose calls ran that
      model version's signature at that priority. Predict, Classify or Regress (gRPC or REST) alone give that
      name; where other calls ran it too (KServe ModelInfer, MultiInference, ...) the runs cannot be told apart,
      and ``API`` names them all, sorted and joined by ``+`` (``ModelInfer+Predict``): the label of such a series
      changes when another kind of call first runs it. Runs that no Predict, Classify or Regress call made are
      left out, as TensorFlow Serving has no such calls (warm-up runs, which TensorFlow Serving counts too, are
      in from the first call that runs their signature). Versions and priorities are summed. Failed runs are
      counted, where TensorFlow Serving times successes only; the wait in servex's queue before the run is not
      (see below), where TensorFlow Serving's ``Session::Run`` with batching on includes its batch queue;
    - ``:tensorflow:serving:batching_session:queuing_latency{thread_pool_name}``, only with batching on (TensorFlow
      Serving has it only then): ``servex_queue_wait_seconds`` of every run, from its arrival in the RunHandler's
      queue to the start of its (batched) run, as TensorFlow Serving's batching session times a task from its
      enqueue to its batch's dequeue; ``thread_pool_name`` is ``""``, as in TensorFlow Serving's model server.
      Requests dropped from the queue (deadline passed, cancelled) are not in it, where TensorFlow Serving counts
      timed-out tasks of a batch;
    - ``:tensorflow:cc:saved_model:load_attempt_count{model_path, status}``: version loads by path (the version's
      folder, as TensorFlow's ``export_dir``) and ``success`` / ``fail``: ``servex_model_load_seconds_count``
      and ``servex_model_load_failures_total``;
    - ``:tensorflow:cc:saved_model:load_latency{model_path}``: the microseconds those loads took, in all
      (``servex_model_load_seconds_sum``). TensorFlow adds failed attempts' time as well (its help text says
      successful loads only); servex does not record how long a failed load took. A servex load is not
      TensorFlow's ``LoadSavedModel`` alone: it reads variables lazily (later, not in the load) and includes the
      version's warm-up, which TensorFlow Serving runs after ``LoadSavedModel``. With ``--serving_processes`` N
      each process loads every version: N attempts per version.
    """

    def __init__(self, source, batching: bool = False):
        self.source = source
        self.batching = batching  # servex's --enable_batching: TensorFlow Serving has a batching queue only then

    def collect(self):
        families: dict[str, list] = {}  # servex's samples by family name
        for family in self.source.collect():
            families.setdefault(family.name, []).extend(family.samples)
        yield from self._requests(families)
        yield self._runtime_latency(families)
        if self.batching:
            yield _microseconds(
                ":tensorflow:serving:batching_session:queuing_latency",
                "Distribution of wall time spent (in microseconds) in queuing",
                ["thread_pool_name"],
                families.get("servex_queue_wait_seconds", ()),
                lambda labels: ("",),
            )
        yield from self._loads(families)

    @staticmethod
    def _requests(families):
        counts: dict[tuple[str, str], float] = {}
        for sample in families.get("servex_requests", ()):
            if sample.name == "servex_requests_total" and sample.labels["method"] in TF_SERVING_APIS:
                key = (sample.labels["model"], sample.labels["code"])
                counts[key] = counts.get(key, 0.0) + sample.value
        count = Metric(":tensorflow:serving:request_count", "The total number of requests.", "unknown")
        for (model, status), value in sorted(counts.items()):
            count.add_sample(":tensorflow:serving:request_count", {"model_name": model, "status": status}, value)
        yield count

        def api(labels):
            found = TF_SERVING_APIS.get(labels.get("method", ""))
            return None if found is None else (labels["model"], *found)

        yield _microseconds(
            ":tensorflow:serving:request_latency",
            "Distribution of wall time (in microseconds) for Tensorflow Serving request.",
            ["model_name", "API", "entrypoint"],
            families.get("servex_request_latency_seconds", ()),
            api,
        )

    @staticmethod
    def _runtime_latency(families):
        # The methods whose calls ran each (model, version, signature, priority): TensorFlow Serving's API names for
        # its own, servex's method names for the others.
        methods: dict[tuple[str, str, str, str], set[str]] = {}
        for sample in families.get("servex_requests", ()):
            labels = sample.labels
            if sample.name == "servex_requests_total" and labels.get("signature"):
                key = (labels["model"], labels["version"], labels["signature"], labels["priority"])
                api = TF_SERVING_APIS.get(labels["method"])
                methods.setdefault(key, set()).add(labels["method"] if api is None else api[0])
        tf_serving = {api for api, _entrypoint in TF_SERVING_APIS.values()}

        def api(labels):
            names = methods.get((labels["model"], labels["version"], labels["signature"], labels["priority"]))
            if not names or names.isdisjoint(tf_serving):
                return None
            return labels["model"], "+".join(sorted(names)), "TF1"

        return _microseconds(
            ":tensorflow:serving:runtime_latency",
            "Distribution of wall time (in microseconds) for Tensorflow runtime.",
            ["model_name", "API", "runtime"],
            families.get("servex_run_seconds", ()),
            api,
        )

    @staticmethod
    def _loads(families):
        attempts: dict[tuple[str, str], float] = {}
        latency: dict[str, float] = {}
        for sample in families.get("servex_model_load_seconds", ()):
            path = sample.labels.get("model_path", "")
            if sample.name == "servex_model_load_seconds_count":
                attempts[(path, "success")] = attempts.get((path, "success"), 0.0) + sample.value
            elif sample.name == "servex_model_load_seconds_sum":
                latency[path] = latency.get(path, 0.0) + sample.value * 1e6
        for sample in families.get("servex_model_load_failures", ()):
            if sample.name == "servex_model_load_failures_total":
                path = sample.labels.get("model_path", "")
                attempts[(path, "fail")] = attempts.get((path, "fail"), 0.0) + sample.value
                latency.setdefault(path, 0.0)  # TensorFlow's cell exists from the first attempt
        name = ":tensorflow:cc:saved_model:load_attempt_count"
        count = Metric(name, "The number of times a SavedModel was successfully loaded.", "unknown")
        for (path, status), value in sorted(attempts.items()):
            count.add_sample(name, {"model_path": path, "status": status}, value)
        yield count
        name = ":tensorflow:cc:saved_model:load_latency"
        total = Metric(name, "Latency in microseconds for SavedModels that were successfully loaded.", "unknown")
        for path, value in sorted(latency.items()):
            total.add_sample(name, {"model_path": path}, value)
        yield total


class TritonNames:
    """Triton's per-model metrics under Triton's names (its ``/metrics``: ``nv_inference_*``, labels ``model`` and
    ``version``), made at scrape time from the Triton statistics servex keeps for ``ModelStatistics``
    (executor/statistics.py), so that dashboards and alerts written for Triton keep working:

    - ``nv_inference_request_success`` / ``nv_inference_request_failure``: inference calls answered OK / with an
      error after their version was resolved (every protocol's: Triton's clients and TensorFlow Serving's);
    - ``nv_inference_count``: rows run; ``nv_inference_exec_count``: runs (a batch counts one);
    - ``nv_inference_request_duration_us``: cumulative time in the server of the calls answered, both kinds;
    - ``nv_inference_queue_duration_us``, ``nv_inference_compute_input_duration_us``,
      ``nv_inference_compute_infer_duration_us``, ``nv_inference_compute_output_duration_us``: cumulative queue,
      decoding, run (per request: its batch's run) and encoding time, in microseconds.

    Triton types them as counters named without ``_total``; prometheus_client would add it to a counter, so they
    are written untyped, as TensorFlow Serving's are here (``rate()`` reads them the same). Triton's pending
    request gauge, GPU and CPU metrics are not made (servex's own: ``servex_queue_depth``, ``process_*``). This
    process's figures: with --serving_processes, where /metrics adds up the processes' files, they are left out.
    """

    _DURATIONS = (
        ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds", "queue"),
        ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds",
         "compute_input"),
        ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
         "compute_infer"),
        ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds",
         "compute_output"),
    )  # fmt: skip

    def collect(self):
        from servex.executor import statistics

        def family(name: str, documentation: str) -> Metric:
            return Metric(name, documentation, "unknown")

        success = family("nv_inference_request_success", "Number of successful inference requests, all batch sizes")
        failure = family("nv_inference_request_failure", "Number of failed inference requests, all batch sizes")
        count = family("nv_inference_count", "Number of inferences performed (does not include cached requests)")
        executions = family("nv_inference_exec_count", "Number of model executions performed")
        duration = family("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds")
        durations = [(family(name, doc), field) for name, doc, field in self._DURATIONS]
        for model, version, stats in statistics.every():
            f = stats.snapshot()
            labels = {"model": model, "version": version}
            success.add_sample(success.name, labels, f.success.count)
            failure.add_sample(failure.name, labels, f.fail.count)
            count.add_sample(count.name, labels, f.inference_count)
            executions.add_sample(executions.name, labels, f.execution_count)
            duration.add_sample(duration.name, labels, (f.success.ns + f.fail.ns) // 1000)
            for metric, field in durations:
                metric.add_sample(metric.name, labels, getattr(f, field).ns // 1000)
        yield from (success, failure, count, executions, duration, *(metric for metric, _ in durations))


_triton_names_registered = False


def register_triton_names() -> None:
    """Serve TritonNames with this process's metrics (once per process)."""
    global _triton_names_registered
    if not _triton_names_registered:
        prometheus_client.REGISTRY.register(TritonNames())
        _triton_names_registered = True


def _microseconds(name: str, documentation: str, label_names: list[str], samples, key_of) -> HistogramMetricFamily:
    """A histogram in microseconds named ``name``, from the ``samples`` of one of servex's histograms (seconds): its
    series summed by ``key_of(labels)``, the new series' label values (None leaves a series out)."""
    buckets: dict[tuple, dict[str, float]] = {}
    sums: dict[tuple, float] = {}
    keys: dict[tuple, tuple | None] = {}  # key_of by the source series' labels, called once per series
    for sample in samples:
        if not sample.name.endswith(("_bucket", "_sum")):
            continue
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        series = tuple(sorted(labels.items()))
        if series not in keys:
            keys[series] = key_of(labels)
        key = keys[series]
        if key is None:
            continue
        if sample.name.endswith("_bucket"):
            cumulative = buckets.setdefault(key, {})
            cumulative[sample.labels["le"]] = cumulative.get(sample.labels["le"], 0.0) + sample.value
        else:
            sums[key] = sums.get(key, 0.0) + sample.value
    histogram = HistogramMetricFamily(name, documentation, labels=label_names)
    for key, cumulative in sorted(buckets.items()):
        ordered = sorted(cumulative.items(), key=lambda item: float(item[0]))  # "+Inf" sorts last
        scaled = [(le if le == "+Inf" else repr(round(float(le) * 1e6, 3)), value) for le, value in ordered]
        histogram.add_metric(list(key), buckets=scaled, sum_value=sums.get(key, 0.0) * 1e6)
    return histogram


def exposition(tf_serving_names: bool = False, batching: bool = False, accept: str = "") -> tuple[bytes, str]:
    """The Prometheus text exposition of every metric and its content type: this process's, or in a group of
    serving processes (prometheus_client's multiprocess mode) all of theirs; with ``tf_serving_names``,
    TensorFlow Serving's metrics as well (``TFServingNames``; ``batching``: servex's --enable_batching). A scraper
    whose ``accept`` header asks for OpenMetrics gets it, with the latency histograms' exemplars (trace ids)."""
    registry = prometheus_client.REGISTRY
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir:
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = prometheus_client.CollectorRegistry()
        MultiProcessCollector(registry, path=metrics_dir)
    if tf_serving_names:
        source, registry = registry, prometheus_client.CollectorRegistry()
        registry.register(source)  # a registry is a collector of its metrics
        registry.register(TFServingNames(source, batching))
    encode, content_type = choose_encoder(accept)
    return encode(registry), content_type


def start_metrics_server(port: int, address: str):
    """Serve /metrics on ``port``; returns the server (``shutdown()`` stops it)."""
    server, _thread = prometheus_client.start_http_server(port, addr=address)
    log.info("Prometheus metrics on http://%s:%d/metrics", address, port)
    return server


# By model and by the version's folder (``model_path``, for TensorFlow's load metrics in ``TFServingNames``):
# one series per version path loaded, as TensorFlow keeps one per ``export_dir``; ``sum by (model)`` reads them
# by model as before.
MODEL_LOAD_FAILURES = Counter(
    "servex_model_load_failures",
    "Version loads that failed (each retry counts), by model and version path",
    ["model", "model_path"],
)
MODEL_LOAD_SECONDS = Histogram(
    "servex_model_load_seconds",
    "Time to load a model version that loaded (lazy restoration: variables are read later), by model and version path",
    ["model", "model_path"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300),
)


def model_load(name: str, version: int, ok: bool, seconds: float, path: str = "") -> None:
    """ModelManager's on_load hook: count failures, time successes, by model and the version's folder."""
    if ok:
        MODEL_LOAD_SECONDS.labels(name, path).observe(seconds)
    else:
        MODEL_LOAD_FAILURES.labels(name, path).inc()
