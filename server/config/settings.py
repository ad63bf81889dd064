"""ServerSettings: every setting of the process, typed, with its default and what it means.

The CLI (server/cli.py) builds one from TensorFlow Serving's flag names; tests and embedders may build one
directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

from servex.server.cores import usable_cores

DEMO_MODEL_NAME = "demo"


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
    # gRPC port (TensorFlow Serving's --port).
    port: int = 8500
    # REST port (TensorFlow Serving's REST API under /v1, KServe v2 under /v2); 0 disables it.
    rest_api_port: int = 8501
    # A REST call not answered this long after it arrived is answered 504 (TensorFlow Serving's flag; a run that
    # had started finishes on its worker, its answer dropped); 0: no deadline.
    rest_api_timeout_in_ms: int = 30000
    # REST answers carry Access-Control-Allow-Origin: * and CORS preflight requests (OPTIONS) are answered, for
    # browser pages of other origins (TensorFlow Serving's --rest_api_enable_cors_support).
    rest_api_enable_cors_support: bool = False
    # Prometheus text exposition at /metrics on this port; 0 disables it.
    metrics_port: int = 8502
    # Address every port binds to.
    bind_address: str = "0.0.0.0"
    # Model served under this name from model_base_path (TensorFlow Serving's default name is "default").
    model_name: str = DEMO_MODEL_NAME
    # Folder of numbered version folders; the highest loads. Default: the bundled demo model.
    model_base_path: str = ""
    # TensorFlow Serving's model config file (text-format ModelServerConfig); replaces model_name/base_path.
    model_config_file: str = ""
    # Re-read the model config file this often (seconds); 0: read it once.
    model_config_file_poll_wait_seconds: float = 0.0
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
    # Look for new and removed version folders this often (seconds); 0 or less: only at start.
    file_system_poll_wait_seconds: float = 1.0
    # A version that fails to load is retried this many times, this far apart (and whenever its files change).
    max_num_load_retries: int = 5
    load_retry_interval_micros: int = 60_000_000
    # Client graphs cached per model version beyond the pinned ones (least recently used evicted); 0: no bound.
    client_graph_cache_size: int = 256
    # Keep the client graphs of signature runs (Predict, Classify, ...) out of eviction.
    pin_signature_graphs: bool = True
    # Read a variable's data only when a client graph first needs it (false: restore everything at load).
    lazy_restore: bool = True
    # Replay a version's assets.extra/tf_serving_warmup_requests (TensorFlow Serving's warm-up records) after it
    # loads and before it serves, this many times each (TensorFlow Serving's flags and defaults).
    enable_model_warmup: bool = True
    num_request_iterations_for_warmup: int = 1
    # Variables restored in the background right after a version loads: model name -> variable names.
    prefetch_variables: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Admin gRPC port (VariableService); 0: off unless a token file is given (then 8503).
    admin_port: int = 0
    # Address the admin port binds to; anything but loopback needs admin_token_file.
    admin_bind_address: str = "127.0.0.1"
    # File holding the bearer token admin calls must send (authorization: Bearer <token>).
    admin_token_file: str = ""
    # Merge concurrent compatible requests of a client graph into one run with TensorFlow Serving's
    # BatchingParameters (TensorFlow Serving's flag): a fixed largest batch, for every graph.
    enable_batching: bool = False
    # Without enable_batching: servex's automatic batching. The RunHandler learns each client graph's run time per
    # batch size while serving and picks its largest batch (the knee of the measured curve, at most
    # auto_max_batch_size rows) and how many of its runs go at once (one for a compute-bound graph, which gets every
    # core; one per run worker where the call is the cost); a graph batches only once its first batch answered as
    # its requests do run alone. executor/cost_model.py says how. --enable_batching=false turns it off.
    auto_batching: bool = True
    auto_max_batch_size: int = 32
    # TensorFlow Serving BatchingParameters in text format (max_batch_size, allowed_batch_sizes, ...).
    batching_parameters_file: str = ""
    # The same, as text, where no file gives them: the batching_parameters of platform_config_file (empty: the
    # defaults).
    batching_parameters: str = ""
    # TensorFlow Serving's --platform_config_file, read by the CLI: its SessionBundleConfig set the batching, session
    # config, tags and warm-up settings here in place of their flags (kept to name it in messages).
    platform_config_file: str = ""
    # With batching on, a version folder's batching_params.pbtxt (BatchingParameters, TensorFlow Serving's
    # per-model file) replaces the server's batching parameters for that version.
    enable_per_model_batching_params: bool = False
    # Requests of one model allowed to wait in the queue; beyond, RESOURCE_EXHAUSTED at once. 0: no bound.
    max_queued_requests: int = 10000
    # Bytes that the input tensors of all queued requests (every model) may hold; a request that would pass it is
    # answered RESOURCE_EXHAUSTED at once, unless nothing is queued. 0: no bound.
    max_queued_bytes: int = 0
    # A waiting request's priority grows by one every this many milliseconds (0: no aging).
    priority_aging_ms: float = 100.0
    # While more work waits, a run worker keeps the answers of short runs for about this long and hands them back
    # to the event loop together: one wake-up of the loop for several answers (0: each answer at once). Never when
    # nothing waits, after or before a run this long or longer, or while requests of several priorities arrive
    # (priority isolation comes first). Measured on 2 cores, MLP, 32 callers: 3,220 -> 4,800 requests/s.
    result_hold_micros: int = 1000
    # While requests of a higher priority arrive (one in the last second), run workers start lower-priority
    # requests at most this many at a time, the next ones only once the event loop has worked through the answers
    # before: every call passes through the loop in arrival order, and paced, the flood leaves it room for the
    # higher priority. 0: no pacing. Measured on 2 cores, MLP, 32 priority-0 callers against one priority-10:
    # that caller's p99 1.8-1.9x idle instead of 2.6-3.0x (7-8x with batching); the flood meanwhile 2,300-2,600
    # req/s instead of 3,000-3,150 (6,900-7,700 with batching).
    lower_priority_burst: int = 1
    # Largest gRPC message accepted or sent, largest decoded input tensor (and total of a request's broadcast inputs,
    # or of its inputs read from shared memory), and largest REST request body (on the wire and decompressed), in
    # bytes.
    max_message_bytes: int = 256 * 1024 * 1024
    # Worker threads that run TensorFlow (RunHandler); default: one per core servex may use (server/cores.py: its
    # CPU affinity and cgroup quota) but one, which is left to the event loop and gRPC (at least 1). Measured on 2
    # cores with the MLP against one per core: priority isolation 3.3x at p99 instead of 9x, 5-10% lower mean
    # latency at one caller, req/s at 32 callers within 5%.
    num_run_workers: int = field(default_factory=lambda: max(1, usable_cores() - 1))
    # TensorFlow's intra-op and inter-op thread pools, one each for the whole process (TensorFlow sizes them once,
    # for its first session). 0: one thread per core servex may use, so that a compute-bound run (a convolution
    # network, an encoder) spreads each op over every core, while a small graph's ops stay on the run worker that
    # runs them (TensorFlow splits an op only where its cost pays for it).
    tensorflow_intra_op_parallelism: int = 0
    tensorflow_inter_op_parallelism: int = 0
    # A TensorFlow session ConfigProto, serialized (TensorFlow Serving's --tensorflow_session_config_file, read
    # by the CLI): the base of every version's session config; the thread pools above and
    # per_process_gpu_memory_fraction apply over it where given on the command line. Empty: TensorFlow's defaults.
    tensorflow_session_config: bytes = b""
    # Share of each GPU's memory TensorFlow may take (TensorFlow Serving's flag); 0: TensorFlow decides.
    per_process_gpu_memory_fraction: float = 0.0
    # The SavedModel tags whose MetaGraphDef loads (TensorFlow Serving's --saved_model_tags, comma-separated).
    saved_model_tags: tuple[str, ...] = ("serve",)
    # gRPC channel arguments for the gRPC port (TensorFlow Serving's --grpc_channel_arguments, key=value pairs:
    # integers where they parse as one), e.g. grpc.max_connection_age_ms. They win over servex's own (the message
    # size limits of max_message_bytes).
    grpc_channel_arguments: tuple[tuple[str, int | str], ...] = ()
    # TLS on the gRPC port and the admin port (TensorFlow Serving's --ssl_config_file); None: plaintext. REST and
    # the metrics port stay plaintext, as TensorFlow Serving's REST port does.
    grpc_tls: TlsSettings | None = None
    # Serve gRPC on this UNIX domain socket as well, with the same services and TLS (TensorFlow Serving's
    # --grpc_socket_path); one listener serves it, and in a group of serving processes the first process does.
    # Empty: TCP only.
    grpc_socket_path: str = ""
    # Serve the Prometheus metrics on the REST port at this path as well (TensorFlow Serving's
    # --monitoring_config_file: prometheus_config { enable: true path: "..." }); empty: only on metrics_port.
    prometheus_rest_path: str = ""
    # Run a graph's ops on the worker thread itself instead of handing them to TensorFlow's inter-op pool
    # (RunOptions.inter_op_thread_pool = -1): far less latency for small graphs.
    run_in_caller_thread: bool = True
    # Device the transfer executor targets: "cpu", "gpu:N" (CuPy; fails at start without it) or "auto".
    device: str = "cpu"
    # Answer Predict outputs in tensor_content instead of TensorFlow Serving's typed *_val fields.
    tensor_content_outputs: bool = False
    # gRPC listeners on the port in this process (SO_REUSEPORT; the kernel spreads connections over them), each
    # accepting calls on its own: grpcio's asyncio server accepts one call at a time per listener, which limits a
    # process under load more than the work does (measured on 2 cores, MLP, 32 callers on 4 connections, batching:
    # 4,600-4,900 requests/s with 1, 5,800-7,800 with 8). One connection is served by one listener, and the kernel
    # picks it by a hash of the connection's addresses, so two of a client's connections may land on one listener
    # and share its accepts: with 4 connections, 59% of the time among 8 listeners, 18% among 32 (measured there:
    # 7,031 against 8,026 requests/s, medians of 9 alternating runs). An idle listener costs a socket and a task.
    grpc_listeners: int = 32
    # Pin the event loop thread (gRPC and REST calls, request handling) once the models are in, to this CPU: an
    # index among the CPUs the process may run on (on a whole host, CPU N). Other threads keep every CPU. -1: the
    # scheduler places it (the default: on a node where pods share CPUs, pinned loops could pile onto one).
    # Measured on 2 cores, MLP, batching, 32 callers: about 6% more requests/s with 8 listeners, none with 32. In
    # a group of serving processes, each takes the next allowed CPU. server/affinity.py says more.
    event_loop_cpu: int = -1
    # Processes serving the same ports (SO_REUSEPORT; the kernel spreads connections), each with its own copy of
    # the models and its own event loop: more throughput from more cores, for more memory. 1: this process serves.
    serving_processes: int = 1
    # Set by the supervisor of several serving processes on each of them (not a user setting): the group's size.
    process_group_size: int = 1
    # On SIGTERM/SIGINT: how long in-flight calls may take to finish before the process exits.
    drain_seconds: float = 20.0

    def resolved_model_base_path(self) -> str:
        return self.model_base_path or demo_model_base_path()
