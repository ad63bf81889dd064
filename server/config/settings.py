"""ServerSettings: every setting of the process, typed, with its default and what it means.

A setting given by a flag of the `servex` command declares that flag on its field (its spelling, help text and
TensorFlow Serving counterpart: server/config/flagspec.py); the CLI (server/cli.py) builds the settings from the
command line; tests and embedders may build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

from servex.server.config.flagspec import (
    ADMIN,
    BATCHING,
    GRPC,
    MODELS,
    OBSERVABILITY,
    PORTS,
    PROCESS,
    TENSORFLOW,
    VERSIONS,
    flag,
)
from servex.server.cores import usable_cores

DEMO_MODEL_NAME = "demo"
SERVE_TAGS = ("serve",)  # the SavedModel tags loaded by default


def demo_model_base_path() -> str:
    """The small SavedModel shipped inside the distribution, served when no model is given."""
    return str(resources.files("servex.server") / "demo_model")


@dataclass(frozen=True)
class TlsSettings:
    """TLS of the gRPC ports (TensorFlow Serving's SSLConfig; server/transport/tls.py reads and checks one): PEM
    text."""

    # The server's private key, unencrypted (left out of the dataclass's repr).
    server_key: str = field(repr=False)
    # The server's certificate chain, leaf first.
    server_cert: str
    # Certificate authorities a client certificate must chain to (needed with client_verify).
    custom_ca: str = ""
    # Require and verify a client certificate (mutual TLS); False: none is asked for.
    client_verify: bool = False
    # The files these were read from, followed for certificate rotation: (the SSLConfig file,) or (certificate,
    # key, CA or "") for the PEM file flags; (): fixed.
    sources: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class ServerSettings:
    """Each field's flag is declared on it (``flag(default, group, help, ...)``, server/config/flagspec.py): the
    parser, ``servex --help`` and docs/flags.md are made from these declarations (server/config/flags.py)."""

    port: int = flag(8500, PORTS, "gRPC port", tfserving=True)
    rest_api_port: int = flag(
        8501, PORTS, "REST port (TensorFlow Serving's REST API, KServe v2 REST), 0 disables", tfserving=True
    )
    rest_api_timeout_in_ms: int = flag(
        30000,
        PORTS,
        "a REST call not answered this long after it arrived is answered 504 (0: no deadline); a run that had "
        "started finishes on its worker, its answer dropped",
        tfserving=True,
        doc="The v2 `timeout` parameter can only shorten the time a request may wait in the queue.",
    )
    rest_api_body_timeout_in_ms: int = flag(
        30000,
        PORTS,
        "a REST request whose body has not all arrived this long after its headers is answered 408 and its "
        "connection closed (0: no limit), so that clients trickling their bodies cannot hold connections",
    )
    rest_api_enable_cors_support: bool = flag(
        False,
        PORTS,
        "REST answers carry Access-Control-Allow-Origin: *, and CORS preflight (OPTIONS) requests are answered, "
        "so that browser pages of other origins can call the REST API (TensorFlow Serving's flag)",
        tfserving=True,
        doc="Errors carry it too; a preflight is answered 204 with the methods and the headers asked for.",
    )
    metrics_port: int = flag(8502, PORTS, "port of the Prometheus /metrics endpoint, 0 disables")
    bind_address: str = flag("0.0.0.0", PORTS, "address the ports bind to")
    model_name: str = flag(
        DEMO_MODEL_NAME,
        MODELS,
        f"name the model is served under (default: 'default' with --model_base_path, else {DEMO_MODEL_NAME!r})",
        flag_default=None,
        doc_default=f"`default` with `--model_base_path`, else `{DEMO_MODEL_NAME}`",
        tfserving=True,
    )
    model_base_path: str = flag(
        "",
        MODELS,
        "folder holding numbered version folders of a SavedModel; the highest loads (default: the bundled demo model)",
        flag_default=None,
        doc_default="the bundled demo model",
        tfserving=True,
    )
    model_config_file: str = flag(
        "",
        MODELS,
        "TensorFlow Serving model config file (text-format ModelServerConfig, ${VAR} expanded from the "
        "environment); serves several models, with version policies and labels; --model_name and "
        "--model_base_path are then ignored",
        flag_default=None,
        tfserving=True,
        doc="Giving them too is logged, as in TensorFlow Serving.",
    )
    model_config_file_poll_wait_seconds: float = flag(
        0.0, MODELS, "re-read --model_config_file this often and apply changes; 0 reads it once", tfserving=True
    )
    # Triton model repositories (Triton's --model-repository, loader/model_repository.py): each folder in one is a
    # model (config.pbtxt, numbered version folders holding model.savedmodel); they replace model_name/base_path
    # and the model config file.
    model_repositories: tuple[str, ...] = ()
    # Triton's --model-control-mode over the repositories: "none" (every model loads at start, nothing changes
    # after), "poll" (the repositories are read again every file_system_poll_wait_seconds: models and versions
    # added, removed or changed) or "explicit" (load_models at start; the repository extension loads and unloads).
    model_control_mode: str = "none"
    # With model_control_mode "explicit": the models loaded at start ("*": all of them).
    load_models: tuple[str, ...] = ()
    # Triton's auto-complete of a repository model's config.pbtxt from its SavedModel: with it, a model whose
    # SavedModel batches and whose file gives no max_batch_size gets triton_default_max_batch_size, and dynamic
    # batching where that is more than 1 (Triton's --disable-auto-complete-config turns it off; its
    # --backend-config=tensorflow,default-max-batch-size=N sets N). Inputs and outputs are completed either way.
    triton_auto_complete: bool = True
    triton_default_max_batch_size: int = 4
    # The header the model repository extension asks of callers on the inference ports, per protocol ("grpc",
    # "http"): (lowercase key, value), from Triton's --grpc-restricted-protocol / --http-restricted-api
    # model-repository:KEY=VALUE. None given: open, as in Triton.
    repository_restrictions: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Exit (code 1) when a model fails to load at start, where servex otherwise serves the others (Triton's
    # --exit-on-error, default true there).
    exit_on_error: bool = False
    # The server is ready only while every configured model has a version available (Triton's --strict-readiness,
    # default true there); False: ready once the start-up loads are over and one model serves.
    strict_readiness: bool = False
    file_system_poll_wait_seconds: float = flag(
        1.0, MODELS, "look for new or removed version folders this often; 0 or less: only at start", tfserving=True
    )
    max_num_load_retries: int = flag(
        5, MODELS, "retries of a version that failed to load (it is also retried whenever its files change)",
        tfserving=True,
    )  # fmt: skip
    load_retry_interval_micros: int = flag(
        60_000_000, MODELS, "time between retries of a failed load, in microseconds", tfserving=True
    )
    client_graph_cache_size: int = flag(
        256,
        VERSIONS,
        "client graphs cached per model version besides pinned ones; least recently used are evicted; 0: no bound",
    )
    pin_signature_graphs: bool = flag(
        True, VERSIONS, "keep the client graphs of signature runs (Predict and friends) out of eviction"
    )
    lazy_restore: bool = flag(
        True,
        VERSIONS,
        "read a variable's data only when a client graph first needs it; false restores every variable at "
        "load (load-time failure for users who want it)",
    )
    enable_model_warmup: bool = flag(
        True,
        VERSIONS,
        "replay a version's assets.extra/tf_serving_warmup_requests after it loads, before it serves",
        tfserving=True,
    )
    num_request_iterations_for_warmup: int = flag(
        1, VERSIONS, "times each warm-up record is replayed (at least 1)", tfserving=True
    )
    # model name -> variable names
    prefetch_variables: dict[str, tuple[str, ...]] = flag(
        group=VERSIONS,
        help="variables of MODEL restored in the background right after each version loads (repeatable)",
        default_factory=dict,
        type=str,
        flag_default=(),
        repeatable=True,
        metavar="MODEL=VAR[,VAR...]",
    )
    admin_port: int = flag(
        0,
        ADMIN,
        "port of the admin gRPC API (servex.v1.VariableService); 0: off, unless --admin_token_file is given "
        "(then 8503)",
    )
    admin_bind_address: str = flag(
        "127.0.0.1", ADMIN, "address the admin port binds to; any but loopback requires --admin_token_file"
    )
    admin_token_file: str = flag(
        "", ADMIN, "file holding the bearer token every admin call must send as 'authorization: Bearer TOKEN'"
    )
    # True: TensorFlow Serving's batching, a fixed largest batch for every graph.
    enable_batching: bool = flag(
        False,
        BATCHING,
        "TensorFlow Serving's batching: merge concurrent compatible requests of one client graph into one run "
        "of at most the BatchingParameters' max_batch_size rows (never waits to fill a batch). Not given: servex's "
        "automatic batching, which learns each graph's cost and picks its batch size and concurrency; "
        "--enable_batching=false: no batching at all",
        flag_default=None,
        doc_default="not given",
        tfserving=True,
        doc="Automatic batching: [scheduling.md](scheduling.md).",
    )
    # Without enable_batching: servex's automatic batching. The RunHandler learns each client graph's run time per
    # batch size while serving and picks its largest batch (the knee of the measured curve, at most
    # auto_max_batch_size rows) and how many of its runs go at once (a compute-bound graph: one or
    # auto_compute_bound_runs, each spread over every core, by trial; one per run worker where the call is the
    # cost); a graph batches only once its first batch answered as its requests do run alone.
    # executor/cost_model.py says how. --enable_batching=false turns it off.
    auto_batching: bool = True
    auto_max_batch_size: int = flag(32, BATCHING, "automatic batching: the largest batch it may pick, in rows")
    auto_compute_bound_runs: int = flag(  # the RunHandler's own default is executor/cost_model.py's (the same)
        2,
        BATCHING,
        "automatic batching: the most runs of a compute-bound client graph that go at once, each spread over every "
        "core; while the graph is busy servex tries one at a time against this many and keeps the one that serves "
        "more (1: one at a time, never tried)",
        doc="How it is tried: [scheduling.md](scheduling.md).",
    )
    batching_parameters_file: str = flag(
        "",
        BATCHING,
        "TensorFlow Serving BatchingParameters in text format: max_batch_size (default 32), "
        "allowed_batch_sizes (padded up to); implies --enable_batching",
        tfserving=True,
    )
    # The same, as text, where no file gives them: the batching_parameters of platform_config_file (empty: the
    # defaults).
    batching_parameters: str = ""
    # Its SessionBundleConfig sets the batching, session config, tags and warm-up settings here in place of their
    # flags (kept to name it in messages).
    platform_config_file: str = flag(
        "",
        TENSORFLOW,
        "TensorFlow Serving's PlatformConfigMap in text format: the 'tensorflow' platform's "
        "SessionBundleConfig (session_config, batching_parameters, saved_model_tags, enable_model_warmup, "
        "model_warmup_options, enable_per_model_batching_params) replaces the batching, session, tag and warm-up "
        "flags, as in TensorFlow Serving",
        tfserving=True,
        doc="The file is read as TensorFlow Serving reads it: the `tensorflow` platform's "
        "`SavedModelBundleSourceAdapterConfig` `legacy_config`. Each replaced flag given is logged as ignored. Its "
        "`batching_parameters`, even empty, turn batching on; warm-up is off unless it sets `enable_model_warmup` "
        "(both as in TensorFlow Serving); pools its `session_config` leaves at 0 take servex's defaults. Fields "
        "that change nothing here (TensorFlow Lite, load thread pools, ...) and other platforms are logged; a "
        "`session_target`, `experimental_fixed_input_tensors`, another adapter config type (TFRT's) or no "
        "`tensorflow` platform stop servex at start (exit 2, named).",
    )
    enable_per_model_batching_params: bool = flag(
        False,
        BATCHING,
        "with batching on, a version folder's batching_params.pbtxt (BatchingParameters) replaces the server's "
        "batching parameters for that model version",
        name="enable_per_model_batching_parameters",
        aliases=("enable_per_model_batching_params",),
        tfserving="enable_per_model_batching_params",
    )
    max_queued_requests: int = flag(
        10000,
        BATCHING,
        "requests of one model that may wait for a worker; beyond, RESOURCE_EXHAUSTED at once (0: no bound)",
    )
    max_queued_bytes: int = flag(
        0,
        BATCHING,
        "bytes that the input tensors of all queued requests may hold; a request that would pass it gets "
        "RESOURCE_EXHAUSTED at once, unless nothing is queued (0: no bound)",
    )
    max_memory_bytes: int = flag(
        0,
        BATCHING,
        "the memory servex may use, in bytes: work (a request's message, a run's inputs and outputs, a client "
        "graph's build, a lazy restore) that would take it past that gets RESOURCE_EXHAUSTED (REST 429) at once "
        "(0: the cgroup's memory limit, if any; serving processes share it)",
        doc="See [Scheduling](scheduling.md#memory-aware-admission).",
    )
    priority_aging_ms: float = flag(
        100.0,
        BATCHING,
        "a waiting request's priority grows by one every this many ms, so low priority still progresses (0: no aging)",
    )
    # Measured on 2 cores, MLP, 32 callers: 3,220 -> 4,800 requests/s.
    result_hold_micros: int = flag(
        1000,
        BATCHING,
        "while more work waits, a run worker keeps the answers of short runs for about this long and hands "
        "them back together (fewer event-loop wake-ups under load; never when nothing waits, next to a run this "
        "long, or while requests of several priorities arrive; 0: each at once)",
    )
    # Every call passes through the event loop in arrival order; paced, the flood leaves it room for the higher
    # priority. Measured on 2 cores, MLP, 32 priority-0 callers against one priority-10: that caller's p99
    # 1.8-1.9x idle instead of 2.6-3.0x (7-8x with batching); the flood meanwhile 2,300-2,600 req/s instead of
    # 3,000-3,150 (6,900-7,700 with batching).
    lower_priority_burst: int = flag(
        1,
        BATCHING,
        "while requests of a higher priority arrive, run workers start lower-priority requests at most this "
        "many at a time, the next ones once the event loop has caught up (room for the higher priority; 0: off)",
    )
    max_message_bytes: int = flag(
        256 * 1024 * 1024,
        GRPC,
        "largest gRPC message received or sent, largest decoded input tensor (and total of a request's broadcast "
        "inputs, or of its inputs read from shared memory), largest REST body (also once decompressed), and largest "
        "batch of inputs padded by pad_variable_length_inputs, in bytes",
        doc="Beyond it: RESOURCE_EXHAUSTED (REST 413). REST JSON (a `/v1` body, the JSON part of a `/v2` body) may "
        "have a quarter of it.",
    )
    # One core is left to the event loop and gRPC. Measured on 2 cores with the MLP against one per core: priority
    # isolation 3.3x at p99 instead of 9x, 5-10% lower mean latency at one caller, req/s at 32 callers within 5%.
    num_run_workers: int = flag(
        group=TENSORFLOW,
        help="worker threads that run TensorFlow (default: CPU cores minus one, left to the event loop; at least 1)",
        default_factory=lambda: max(1, usable_cores() - 1),
        doc_default="cores - 1 (at least 1)",
        doc="Cores here and below: those servex may use, its CPU affinity bounded by its cgroup's CPU quota "
        "(server/cores.py).",
    )
    # One pool each for the whole process (TensorFlow sizes them once, for its first session): a compute-bound run
    # spreads each op over every core, while a small graph's ops stay on the run worker that runs them (TensorFlow
    # splits an op only where its cost pays for it).
    tensorflow_intra_op_parallelism: int = flag(
        0,
        TENSORFLOW,
        "TensorFlow intra-op threads (default 0: one per core servex may use, by its CPU affinity and cgroup "
        "quota, in a pool per model version, and a second session of one thread for client graphs found faster "
        "there: docs/scheduling.md, Cores); set, one pool for the process, of that many threads, and no second "
        "session",
        flag_default=None,
        doc_default="0 (the cores)",
        tfserving=True,
    )
    tensorflow_inter_op_parallelism: int = flag(
        0,
        TENSORFLOW,
        "TensorFlow inter-op threads (default 0: one per core servex may use)",
        flag_default=None,
        doc_default="0 (the cores)",
        tfserving=True,
        doc="Compute-bound graphs that run faster handed to it run there (the scheduler tries both).",
    )
    # A TensorFlow session ConfigProto, serialized (--tensorflow_session_config_file's, read by the CLI): the base
    # of every version's session config; the thread pools above and per_process_gpu_memory_fraction apply over it
    # where given on the command line. Empty: TensorFlow's defaults.
    tensorflow_session_config: bytes = b""
    per_process_gpu_memory_fraction: float = flag(
        0.0,
        TENSORFLOW,
        "share of each GPU's memory TensorFlow may take (0: TensorFlow decides)",
        tfserving=True,
    )
    saved_model_tags: tuple[str, ...] = flag(
        SERVE_TAGS,
        MODELS,
        "comma-separated tags of the MetaGraphDef to load from each SavedModel",
        type=str,
        flag_default=",".join(SERVE_TAGS),
        tfserving=True,
    )
    # key=value pairs; they win over servex's own (the message size limits of max_message_bytes).
    grpc_channel_arguments: tuple[tuple[str, int | str], ...] = flag(
        (),
        GRPC,
        "gRPC channel arguments for the gRPC port, comma-separated key=value pairs (integers where they "
        "parse as one), e.g. grpc.max_connection_age_ms=60000",
        type=str,
        flag_default="",
        doc_default="none",
        tfserving=True,
        doc="Values parse as 32-bit integers where they can, else strings, as TensorFlow Serving passes them. They "
        "win over servex's own, but gRPC's message size limits are `--max_message_bytes`'s (given here, they are "
        "logged and left out).",
    )
    # TLS on the gRPC port and the admin port (--ssl_config_file, or the PEM file flags); None: plaintext. REST and
    # the metrics port stay plaintext, as TensorFlow Serving's REST port does.
    grpc_tls: TlsSettings | None = None
    grpc_socket_path: str = flag(
        "",
        GRPC,
        "serve gRPC on this UNIX domain socket too (clients dial unix:PATH), every service and TLS as on "
        "--port; with --serving_processes, the first process serves it",
        tfserving=True,
        doc="A socket another process serves, or a path that is not a socket, stops servex at start (exit 1, "
        "named); a socket left by a killed process is replaced; the socket is removed at stop. Longer than 107 "
        "bytes: exit 2.",
    )
    # Serve the Prometheus metrics on the REST port at this path as well (--monitoring_config_file's
    # prometheus_config { enable: true path: "..." }); empty: only on metrics_port.
    prometheus_rest_path: str = ""
    run_in_caller_thread: bool = flag(
        True,
        TENSORFLOW,
        "run graph ops on the run worker's own thread (lowest latency for small graphs); "
        "false hands them to TensorFlow's inter-op pool",
    )
    xla: bool = flag(
        True,
        TENSORFLOW,
        "a compute-bound client graph of a TF2 SavedModel tries its function compiled with XLA for its lone runs, "
        "and keeps it where it is faster and answers the same; false: TensorFlow's own kernels only",
        doc="How it is tried and checked: [scheduling.md](scheduling.md#xla).",
    )
    device: str = flag(
        "cpu",
        TENSORFLOW,
        "device inputs are transferred to: cpu (sessions then see no GPU, and CUDA is never initialised), gpu:N "
        "(needs CuPy and CUDA: pip install 'servex[gpu]'; exits 1 at start without them), or auto (gpu:0 when "
        "usable, else cpu, logged)",
    )
    tensor_content_outputs: bool = flag(
        False,
        GRPC,
        "encode Predict outputs in tensor_content rather than TensorFlow Serving's typed fields",
        aliases=("enable_serialization_as_tensor_content",),
        tfserving="enable_serialization_as_tensor_content",
    )
    # Hashed by their addresses, two of a client's connections may land on one listener and share its accepts: with
    # 4 connections, 59% of the time among 8 listeners, 18% among 32. Measured so on 2 cores, MLP, 32 callers on 4
    # connections, batching: 4,600-4,900 requests/s with 1 listener, 5,800-7,800 with 8; 7,031 with 8 against 8,026
    # with 32 (medians of 9 alternating runs). By source port (listeners.py), a client's connections go round all
    # the listeners before two share one. An idle listener costs a socket and a task.
    grpc_listeners: int = flag(
        32,
        GRPC,
        "gRPC listeners sharing --port in this process (SO_REUSEPORT), each accepting calls on its own: "
        "grpcio's asyncio server accepts one call at a time per listener; a client's connections go to different "
        "listeners (by source port)",
        doc="See [Several listeners on the gRPC port](processes.md#several-listeners-on-the-grpc-port).",
    )
    # -1 by default: on a node where pods share CPUs, pinned loops could pile onto one. Measured on 2 cores, MLP,
    # batching, 32 callers: about 6% more requests/s with 8 listeners, none with 32. server/affinity.py says more.
    event_loop_cpu: int = flag(
        -1,
        PROCESS,
        "pin the event loop thread, once the models are in, to this CPU: an index among the CPUs the process "
        "may run on (0: the first; on a whole host, CPU N). Other threads keep every CPU. -1: leave it to the "
        "scheduler. For dedicated hosts or whole-CPU pods; in a process group each process takes the next",
        doc="See [The event loop's own CPU](processes.md#the-event-loops-own-cpu).",
    )
    serving_processes: int = flag(
        1,
        PROCESS,
        "processes serving the same ports (SO_REUSEPORT), each with its own copy of the models: more cores, "
        "more throughput, more memory; /metrics adds them up",
        doc="See [Several serving processes](processes.md#several-serving-processes).",
    )
    process_group_size: int = flag(
        1, PROCESS, "set by the supervisor of several serving processes on each of them: the group's size", hidden=True
    )
    drain_seconds: float = flag(20.0, PROCESS, "on SIGTERM/SIGINT, how long in-flight calls may take to finish")
    trace_config: tuple[str, ...] = flag(
        (),
        OBSERVABILITY,
        "request tracing, in Triton's --trace-config syntax (repeatable): level=TIMESTAMPS turns it on, rate=N "
        "traces one request in N (1000), count=N stops after N traces (-1), mode=triton|opentelemetry; "
        "triton,file=PATH and triton,log-frequency=N; opentelemetry,url=HOST:PORT (OTLP/gRPC), "
        "opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_max_queue_size|bsp_schedule_delay|"
        "bsp_max_export_batch_size=N",
        type=str,
        flag_default=(),
        repeatable=True,
        aliases=("trace-config",),
        metavar="[MODE,]SETTING=VALUE",
        doc_default="none (tracing off)",
        doc="See [Tracing](tracing.md). OpenTelemetry's standard `OTEL_*` environment variables configure what "
        "the flag leaves unset (the collector's endpoint, the service name, the sampler).",
    )
    enable_profiler: bool = flag(
        True,
        OBSERVABILITY,
        "serve tensorflow.ProfilerService on the gRPC port, so that TensorBoard's Profile tab and "
        "tf.profiler.experimental.client.trace can capture live runs",
        tfserving=True,
    )

    def resolved_model_base_path(self) -> str:
        return self.model_base_path or demo_model_base_path()
