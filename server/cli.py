"""The `servex` command: TensorFlow Serving's flag names, parsed into ServerSettings.

TensorFlow is imported only after the flags are parsed, so `servex --help` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NamedTuple

from servex.server import affinity
from servex.server.config import tfserving_flags, triton_flags
from servex.server.config.settings import DEMO_MODEL_NAME, ServerSettings
from servex.server.transport import tls


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_bool(p: argparse.ArgumentParser, *flags: str, default: bool, help: str) -> None:
    """A boolean flag as TensorFlow Serving spells them: ``--flag``, ``--flag=true`` or ``--flag=false`` (the
    first spelling names the setting; others are aliases)."""
    p.add_argument(*flags, type=_bool, nargs="?", const=True, default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    d = ServerSettings()
    p = argparse.ArgumentParser(
        prog="servex",
        description="Serve TensorFlow SavedModels over TensorFlow Serving's gRPC API. With no model flags, "
        f"serves the bundled demo model as {DEMO_MODEL_NAME!r}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--port", type=int, default=d.port, help="gRPC port")
    p.add_argument(
        "--rest_api_port",
        type=int,
        default=d.rest_api_port,
        help="REST port (TensorFlow Serving's REST API, KServe v2 REST), 0 disables",
    )
    p.add_argument(
        "--rest_api_timeout_in_ms",
        type=int,
        default=d.rest_api_timeout_in_ms,
        help="a REST call not answered this long after it arrived is answered 504 (0: no deadline); a run that had "
        "started finishes on its worker, its answer dropped",
    )
    _add_bool(
        p,
        "--rest_api_enable_cors_support",
        default=d.rest_api_enable_cors_support,
        help="REST answers carry Access-Control-Allow-Origin: *, and CORS preflight (OPTIONS) requests are answered, "
        "so that browser pages of other origins can call the REST API (TensorFlow Serving's flag)",
    )
    p.add_argument(
        "--metrics_port", type=int, default=d.metrics_port, help="port of the Prometheus /metrics endpoint, 0 disables"
    )
    p.add_argument("--bind_address", default=d.bind_address, help="address the ports bind to")
    p.add_argument(
        "--model_name",
        default=None,
        help=f"name the model is served under (default: 'default' with --model_base_path, else {DEMO_MODEL_NAME!r})",
    )
    p.add_argument(
        "--model_base_path",
        default=None,
        help="folder holding numbered version folders of a SavedModel; the highest loads "
        "(default: the bundled demo model)",
    )
    p.add_argument(
        "--model_config_file",
        default=None,
        help="TensorFlow Serving model config file (text-format ModelServerConfig, ${VAR} expanded from the "
        "environment); serves several models, with version policies and labels; --model_name and "
        "--model_base_path are then ignored",
    )
    p.add_argument(
        "--model_config_file_poll_wait_seconds",
        type=float,
        default=d.model_config_file_poll_wait_seconds,
        help="re-read --model_config_file this often and apply changes; 0 reads it once",
    )
    p.add_argument(
        "--file_system_poll_wait_seconds",
        type=float,
        default=d.file_system_poll_wait_seconds,
        help="look for new or removed version folders this often; 0 or less: only at start",
    )
    p.add_argument(
        "--max_num_load_retries",
        type=int,
        default=d.max_num_load_retries,
        help="retries of a version that failed to load (it is also retried whenever its files change)",
    )
    p.add_argument(
        "--load_retry_interval_micros",
        type=int,
        default=d.load_retry_interval_micros,
        help="time between retries of a failed load, in microseconds",
    )
    p.add_argument(
        "--client_graph_cache_size",
        type=int,
        default=d.client_graph_cache_size,
        help="client graphs cached per model version besides pinned ones; least recently used are evicted; 0: no bound",
    )
    _add_bool(
        p,
        "--pin_signature_graphs",
        default=d.pin_signature_graphs,
        help="keep the client graphs of signature runs (Predict and friends) out of eviction",
    )
    _add_bool(
        p,
        "--lazy_restore",
        default=d.lazy_restore,
        help="read a variable's data only when a client graph first needs it; false restores every variable at "
        "load (load-time failure for users who want it)",
    )
    _add_bool(
        p,
        "--enable_model_warmup",
        default=d.enable_model_warmup,
        help="replay a version's assets.extra/tf_serving_warmup_requests after it loads, before it serves",
    )
    p.add_argument(
        "--num_request_iterations_for_warmup",
        type=int,
        default=d.num_request_iterations_for_warmup,
        help="times each warm-up record is replayed (at least 1)",
    )
    p.add_argument(
        "--prefetch_variables",
        action="append",
        default=[],
        metavar="MODEL=VAR[,VAR...]",
        help="variables of MODEL restored in the background right after each version loads (repeatable)",
    )
    p.add_argument(
        "--admin_port",
        type=int,
        default=d.admin_port,
        help="port of the admin gRPC API (servex.v1.VariableService); 0: off, unless --admin_token_file is given "
        "(then 8503)",
    )
    p.add_argument(
        "--admin_bind_address",
        default=d.admin_bind_address,
        help="address the admin port binds to; any but loopback requires --admin_token_file",
    )
    p.add_argument(
        "--admin_token_file",
        default=d.admin_token_file,
        help="file holding the bearer token every admin call must send as 'authorization: Bearer TOKEN'",
    )
    _add_bool(
        p,
        "--enable_batching",
        default=None,
        help="TensorFlow Serving's batching: merge concurrent compatible requests of one client graph into one run "
        "of at most the BatchingParameters' max_batch_size rows (never waits to fill a batch). Not given: servex's "
        "automatic batching, which learns each graph's cost and picks its batch size and concurrency; "
        "--enable_batching=false: no batching at all",
    )
    p.add_argument(
        "--auto_max_batch_size",
        type=int,
        default=d.auto_max_batch_size,
        help="automatic batching: the largest batch it may pick, in rows",
    )
    p.add_argument(
        "--batching_parameters_file",
        default=d.batching_parameters_file,
        help="TensorFlow Serving BatchingParameters in text format: max_batch_size (default 32), "
        "allowed_batch_sizes (padded up to); implies --enable_batching",
    )
    _add_bool(
        p,
        "--enable_per_model_batching_parameters",
        "--enable_per_model_batching_params",
        default=d.enable_per_model_batching_params,
        help="with batching on, a version folder's batching_params.pbtxt (BatchingParameters) replaces the server's "
        "batching parameters for that model version",
    )
    p.add_argument(
        "--max_queued_requests",
        type=int,
        default=d.max_queued_requests,
        help="requests of one model that may wait for a worker; beyond, RESOURCE_EXHAUSTED at once (0: no bound)",
    )
    p.add_argument(
        "--max_queued_bytes",
        type=int,
        default=d.max_queued_bytes,
        help="bytes that the input tensors of all queued requests may hold; a request that would pass it gets "
        "RESOURCE_EXHAUSTED at once, unless nothing is queued (0: no bound)",
    )
    p.add_argument(
        "--priority_aging_ms",
        type=float,
        default=d.priority_aging_ms,
        help="a waiting request's priority grows by one every this many ms, so low priority still progresses "
        "(0: no aging)",
    )
    p.add_argument(
        "--result_hold_micros",
        type=int,
        default=d.result_hold_micros,
        help="while more work waits, a run worker keeps the answers of short runs for about this long and hands "
        "them back together (fewer event-loop wake-ups under load; never when nothing waits, next to a run this "
        "long, or while requests of several priorities arrive; 0: each at once)",
    )
    p.add_argument(
        "--lower_priority_burst",
        type=int,
        default=d.lower_priority_burst,
        help="while requests of a higher priority arrive, run workers start lower-priority requests at most this "
        "many at a time, the next ones once the event loop has caught up (room for the higher priority; 0: off)",
    )
    p.add_argument(
        "--max_message_bytes",
        type=int,
        default=d.max_message_bytes,
        help="largest gRPC message received or sent, largest decoded input tensor (and total of a request's broadcast "
        "inputs, or of its inputs read from shared memory), largest REST body (also once decompressed), and largest "
        "batch of inputs padded by pad_variable_length_inputs, in bytes",
    )
    p.add_argument(
        "--num_run_workers",
        type=int,
        default=d.num_run_workers,
        help="worker threads that run TensorFlow (default: CPU cores minus one, left to the event loop; at least 1)",
    )
    p.add_argument(
        "--tensorflow_intra_op_parallelism",
        type=int,
        default=None,
        help="TensorFlow intra-op threads, one pool for the process (default 0: one per core servex may use, by "
        "its CPU affinity and cgroup quota); 1 runs each op on the run worker alone",
    )
    p.add_argument(
        "--tensorflow_inter_op_parallelism",
        type=int,
        default=None,
        help="TensorFlow inter-op threads (default 0: one per core servex may use)",
    )
    p.add_argument(
        "--tensorflow_session_parallelism",
        type=int,
        default=0,
        help="both TensorFlow thread pools at once (TensorFlow Serving's flag); a pool's own flag wins over it",
    )
    p.add_argument(
        "--tensorflow_session_config_file",
        default="",
        help="a TensorFlow ConfigProto in text format, the base of every session's config; the thread-pool and "
        "GPU memory flags apply over it where given",
    )
    p.add_argument(
        "--platform_config_file",
        default="",
        help="TensorFlow Serving's PlatformConfigMap in text format: the 'tensorflow' platform's "
        "SessionBundleConfig (session_config, batching_parameters, saved_model_tags, enable_model_warmup, "
        "model_warmup_options, enable_per_model_batching_params) replaces the batching, session, tag and warm-up "
        "flags, as in TensorFlow Serving",
    )
    p.add_argument(
        "--per_process_gpu_memory_fraction",
        type=float,
        default=d.per_process_gpu_memory_fraction,
        help="share of each GPU's memory TensorFlow may take (0: TensorFlow decides)",
    )
    p.add_argument(
        "--saved_model_tags",
        default=",".join(d.saved_model_tags),
        help="comma-separated tags of the MetaGraphDef to load from each SavedModel",
    )
    p.add_argument(
        "--grpc_channel_arguments",
        default="",
        help="gRPC channel arguments for the gRPC port, comma-separated key=value pairs (integers where they "
        "parse as one), e.g. grpc.max_connection_age_ms=60000",
    )
    p.add_argument(
        "--grpc_socket_path",
        default=d.grpc_socket_path,
        help="serve gRPC on this UNIX domain socket too (clients dial unix:PATH), every service and TLS as on "
        "--port; with --serving_processes, the first process serves it",
    )
    p.add_argument(
        "--ssl_config_file",
        default="",
        help="TensorFlow Serving's SSLConfig in text format (server_key, server_cert, custom_ca, client_verify: PEM "
        "text): TLS on the gRPC port and the admin port, client certificates required and checked against "
        "custom_ca with client_verify: true; REST stays plaintext, as in TensorFlow Serving. Re-read when it "
        "changes: new connections get the new certificate",
    )
    p.add_argument(
        "--ssl_server_cert_file",
        default="",
        help="instead of --ssl_config_file: PEM file of the server's certificate chain (a Kubernetes TLS Secret's "
        "tls.crt); with --ssl_server_key_file",
    )
    p.add_argument("--ssl_server_key_file", default="", help="PEM file of the server's private key (tls.key)")
    p.add_argument(
        "--ssl_custom_ca_file",
        default="",
        help="PEM file of the CAs client certificates must chain to (ca.crt); needed with --ssl_client_verify",
    )
    _add_bool(
        p,
        "--ssl_client_verify",
        default=False,
        help="with the PEM file flags: require a client certificate that --ssl_custom_ca_file's CAs signed",
    )
    p.add_argument(
        "--monitoring_config_file",
        default="",
        help="TensorFlow Serving's MonitoringConfig in text format: prometheus_config { enable: true path: ... } "
        "serves the metrics on the REST port at that path too (default path /monitoring/prometheus/metrics)",
    )
    _add_bool(
        p,
        "--run_in_caller_thread",
        default=d.run_in_caller_thread,
        help="run graph ops on the run worker's own thread (lowest latency for small graphs); "
        "false hands them to TensorFlow's inter-op pool",
    )
    p.add_argument(
        "--device",
        default=d.device,
        help="device inputs are transferred to: cpu, gpu:N (needs CuPy and CUDA: pip install 'servex[gpu]'; "
        "exits 1 at start without them), or auto (gpu:0 when usable, else cpu, logged)",
    )
    _add_bool(
        p,
        "--tensor_content_outputs",
        "--enable_serialization_as_tensor_content",
        default=d.tensor_content_outputs,
        help="encode Predict outputs in tensor_content rather than TensorFlow Serving's typed fields",
    )
    p.add_argument(
        "--drain_seconds",
        type=float,
        default=d.drain_seconds,
        help="on SIGTERM/SIGINT, how long in-flight calls may take to finish",
    )
    p.add_argument(
        "--grpc_listeners",
        type=int,
        default=d.grpc_listeners,
        help="gRPC listeners sharing --port in this process (SO_REUSEPORT), each accepting calls on its own: "
        "grpcio's asyncio server accepts one call at a time per listener; the kernel spreads connections over them",
    )
    p.add_argument(
        "--event_loop_cpu",
        type=int,
        default=d.event_loop_cpu,
        help="pin the event loop thread, once the models are in, to this CPU: an index among the CPUs the process "
        "may run on (0: the first; on a whole host, CPU N). Other threads keep every CPU. -1: leave it to the "
        "scheduler. For dedicated hosts or whole-CPU pods; in a process group each process takes the next",
    )
    p.add_argument(
        "--serving_processes",
        type=int,
        default=d.serving_processes,
        help="processes serving the same ports (SO_REUSEPORT), each with its own copy of the models: more cores, "
        "more throughput, more memory; /metrics adds them up",
    )
    p.add_argument("--process_group_size", type=int, default=d.process_group_size, help=argparse.SUPPRESS)
    p.add_argument("--log_level", default="INFO", help="Python logging level")
    p.add_argument("--version", action="store_true", help="print servex's and TensorFlow's versions and exit")
    tfserving_flags.add_other_flags(p)
    triton_flags.add_triton_flags(p, _bool)
    return p


class Parsed(NamedTuple):
    settings: ServerSettings
    log_level: str
    notes: tuple[str, ...]  # warnings about the command line, logged once logging is set up


MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path on Linux, less its terminating NUL


def parse_settings(argv: list[str] | None = None) -> Parsed:
    args = build_parser().parse_args(argv)
    if args.version:
        print(tfserving_flags.versions())
        raise SystemExit(0)
    fail = build_parser().error
    notes = tfserving_flags.check_other_flags(args, fail)
    given = tfserving_flags.given_flags(build_parser(), argv, triton_flags.DEFAULTS_REPLACED)
    triton_flags.apply(args, set(given), fail, notes)
    repositories = tuple(args.triton_model_repository)  # each once
    prefetch = {}
    for item in args.prefetch_variables:
        model, sep, names = item.partition("=")
        if not sep or not model or not names:
            build_parser().error(f"--prefetch_variables expects MODEL=VAR[,VAR...], got {item!r}")
        prefetch[model] = prefetch.get(model, ()) + tuple(n for n in names.split(",") if n)
    admin_port = args.admin_port or (8503 if args.admin_token_file else 0)
    if args.grpc_listeners < 1:
        build_parser().error(f"--grpc_listeners must be at least 1, got {args.grpc_listeners}")
    if args.max_queued_bytes < 0:
        build_parser().error(f"--max_queued_bytes must be 0 (no bound) or more, got {args.max_queued_bytes}")
    if args.lower_priority_burst < 0:
        build_parser().error(f"--lower_priority_burst must be 0 (off) or more, got {args.lower_priority_burst}")
    if args.event_loop_cpu != -1:
        try:
            affinity.resolve(args.event_loop_cpu)
        except ValueError as e:
            build_parser().error(str(e))
    if args.num_request_iterations_for_warmup < 1 and not args.platform_config_file:  # else ignored (noted)
        build_parser().error(
            f"--num_request_iterations_for_warmup must be at least 1, got {args.num_request_iterations_for_warmup}"
        )
    if args.auto_max_batch_size < 1:
        build_parser().error(f"--auto_max_batch_size must be at least 1, got {args.auto_max_batch_size}")
    if args.serving_processes < 1:
        build_parser().error(f"--serving_processes must be at least 1, got {args.serving_processes}")
    if args.serving_processes > 1 and admin_port:
        build_parser().error("the admin API changes one process's variables and models: it needs --serving_processes=1")
    loopback = args.admin_bind_address in ("127.0.0.1", "localhost", "::1")
    if admin_port and not loopback and not args.admin_token_file:
        build_parser().error("--admin_bind_address other than loopback needs --admin_token_file")
    if args.model_config_file is not None and (args.model_base_path is not None or args.model_name is not None):
        notes.append("--model_name and --model_base_path are ignored: --model_config_file names the models (as in "
                     "TensorFlow Serving)")  # fmt: skip
        args.model_name = args.model_base_path = None
    if args.model_name is not None and args.model_base_path is None:
        build_parser().error("--model_name needs --model_base_path")
    platform = None
    if args.platform_config_file:
        platform = tfserving_flags.platform_config(args.platform_config_file, fail, notes)
        for flag in tfserving_flags.given_flags(build_parser(), argv, tfserving_flags.SESSION_BUNDLE_FLAGS):
            notes.append(f"--{flag} is ignored: --platform_config_file's SessionBundleConfig replaces it (as in "
                         f"TensorFlow Serving)")  # fmt: skip
        # The flags it replaces, as the file sets them (pools left at 0 there take servex's defaults, as below).
        args.tensorflow_session_parallelism = 0
        args.tensorflow_intra_op_parallelism = args.tensorflow_inter_op_parallelism = None
        args.per_process_gpu_memory_fraction = 0.0  # the file's session_config has its own
        args.enable_batching, args.batching_parameters_file = platform.enable_batching, ""
        args.enable_per_model_batching_parameters = platform.enable_per_model_batching_params
        args.enable_model_warmup = platform.enable_model_warmup
        args.num_request_iterations_for_warmup = platform.num_request_iterations_for_warmup
    if platform is not None:
        session_config = platform.session_config
    elif args.tensorflow_session_config_file:
        session_config = tfserving_flags.session_config(args.tensorflow_session_config_file, fail)
    else:
        session_config = None
    d = ServerSettings()
    # A pool's own flag, else --tensorflow_session_parallelism, else the session config file, else servex's default.
    pools = {}
    for pool in ("intra", "inter"):
        flag = getattr(args, f"tensorflow_{pool}_op_parallelism")
        from_file = getattr(session_config, f"{pool}_op_parallelism_threads", 0)
        pools[pool] = next(
            v for v in (flag, args.tensorflow_session_parallelism or None, from_file or None,
                        getattr(d, f"tensorflow_{pool}_op_parallelism")) if v is not None
        )  # fmt: skip
    gpu_fraction = args.per_process_gpu_memory_fraction
    if not 0 <= gpu_fraction <= 1:
        fail(f"--per_process_gpu_memory_fraction must be from 0 to 1, got {gpu_fraction}")
    if platform is not None:
        tags = platform.saved_model_tags  # as the file names them
    else:
        tags = tuple(t.strip() for t in args.saved_model_tags.split(",") if t.strip())
    if not tags:
        fail(f"--saved_model_tags names no tag: {args.saved_model_tags!r}")
    prometheus_path = (
        tfserving_flags.prometheus_path(args.monitoring_config_file, fail) if args.monitoring_config_file else ""
    )
    if prometheus_path and not args.rest_api_port:
        notes.append(f"--monitoring_config_file's path {prometheus_path} is not served: the REST port is off "
                     f"(--rest_api_port=0); the metrics stay on --metrics_port")  # fmt: skip
    if len(os.fsencode(args.grpc_socket_path)) > MAX_SOCKET_PATH:
        fail(f"--grpc_socket_path is {len(os.fsencode(args.grpc_socket_path))} bytes long: a UNIX socket's path "
             f"takes at most {MAX_SOCKET_PATH}")  # fmt: skip
    grpc_tls = None
    pem_files = args.ssl_server_cert_file or args.ssl_server_key_file or args.ssl_custom_ca_file
    if args.ssl_config_file and (pem_files or args.ssl_client_verify):
        fail("--ssl_config_file and the PEM file flags (--ssl_server_cert_file, ...) are two ways to give one TLS "
             "configuration: give one of them")  # fmt: skip
    if args.ssl_config_file:
        try:
            grpc_tls = tls.read_ssl_config(args.ssl_config_file)
        except tls.TlsConfigError as e:
            fail(f"--ssl_config_file: {e}")
    elif pem_files or args.ssl_client_verify:
        if not (args.ssl_server_cert_file and args.ssl_server_key_file):
            fail("TLS from PEM files needs both --ssl_server_cert_file and --ssl_server_key_file")
        try:
            grpc_tls = tls.read_pem_files(args.ssl_server_cert_file, args.ssl_server_key_file,
                                          args.ssl_custom_ca_file, args.ssl_client_verify)  # fmt: skip
        except tls.TlsConfigError as e:
            fail(str(e))
    if args.model_base_path is not None:
        name = args.model_name or "default"
    else:
        name = DEMO_MODEL_NAME
    settings = ServerSettings(
        port=args.port,
        rest_api_port=args.rest_api_port,
        rest_api_timeout_in_ms=args.rest_api_timeout_in_ms,
        rest_api_enable_cors_support=args.rest_api_enable_cors_support,
        metrics_port=args.metrics_port,
        bind_address=args.bind_address,
        model_name=name,
        model_base_path=args.model_base_path or "",
        model_config_file=args.model_config_file or "",
        model_config_file_poll_wait_seconds=args.model_config_file_poll_wait_seconds,
        model_repositories=repositories,
        model_control_mode=args.triton_model_control_mode or "none",
        load_models=tuple(args.triton_load_model),
        exit_on_error=bool(repositories and args.triton_exit_on_error),
        strict_readiness=bool(repositories and args.triton_strict_readiness),
        triton_auto_complete=args.repository_auto_complete,
        repository_restrictions=args.repository_restrictions,
        triton_default_max_batch_size=args.repository_default_max_batch_size,
        file_system_poll_wait_seconds=args.file_system_poll_wait_seconds,
        max_num_load_retries=args.max_num_load_retries,
        load_retry_interval_micros=args.load_retry_interval_micros,
        max_message_bytes=args.max_message_bytes,
        enable_batching=bool(args.enable_batching) or bool(args.batching_parameters_file),
        auto_batching=args.enable_batching is None and not args.batching_parameters_file,
        auto_max_batch_size=args.auto_max_batch_size,
        batching_parameters_file=args.batching_parameters_file,
        batching_parameters=platform.batching_parameters if platform is not None else "",
        platform_config_file=args.platform_config_file,
        enable_per_model_batching_params=args.enable_per_model_batching_parameters,
        max_queued_requests=args.max_queued_requests,
        max_queued_bytes=args.max_queued_bytes,
        priority_aging_ms=args.priority_aging_ms,
        result_hold_micros=args.result_hold_micros,
        lower_priority_burst=args.lower_priority_burst,
        lazy_restore=args.lazy_restore,
        enable_model_warmup=args.enable_model_warmup,
        num_request_iterations_for_warmup=args.num_request_iterations_for_warmup,
        prefetch_variables=prefetch,
        admin_port=admin_port,
        admin_bind_address=args.admin_bind_address,
        admin_token_file=args.admin_token_file,
        client_graph_cache_size=args.client_graph_cache_size,
        pin_signature_graphs=args.pin_signature_graphs,
        num_run_workers=args.num_run_workers,
        tensorflow_intra_op_parallelism=pools["intra"],
        tensorflow_inter_op_parallelism=pools["inter"],
        tensorflow_session_config=session_config.SerializeToString() if session_config is not None else b"",
        per_process_gpu_memory_fraction=gpu_fraction,
        saved_model_tags=tags,
        grpc_channel_arguments=tfserving_flags.channel_arguments(args.grpc_channel_arguments, fail, notes),
        grpc_tls=grpc_tls,
        grpc_socket_path=args.grpc_socket_path,
        prometheus_rest_path=prometheus_path if args.rest_api_port else "",
        run_in_caller_thread=args.run_in_caller_thread,
        device=args.device,
        tensor_content_outputs=args.tensor_content_outputs,
        drain_seconds=args.drain_seconds,
        grpc_listeners=args.grpc_listeners,
        event_loop_cpu=args.event_loop_cpu,
        serving_processes=args.serving_processes,
        process_group_size=args.process_group_size,
    )
    return Parsed(settings, args.log_level, tuple(notes))


def main(argv: list[str] | None = None) -> None:
    settings, log_level, notes = parse_settings(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for note in notes:
        logging.getLogger("servex").warning("%s", note)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # gRPC core's own log at ERROR and above (read when grpc is first imported, after this): at INFO it writes a
    # line per failed TLS handshake, so any client could fill the log (40,449 lines in a 10-minute soak).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if settings.serving_processes > 1:
        from servex.server.supervisor import supervise  # no TensorFlow in the supervisor

        sys.exit(supervise(settings, sys.argv[1:] if argv is None else argv))
    # Until the server takes SIGTERM/SIGINT over (to drain), one stops the process at once: nothing is served yet,
    # so there is nothing to drain, and it exits 0 as a drained stop does (a signal's default action would kill it
    # mid-import, which a process group's supervisor then reported as a failure).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_before_serving)
    from servex.server.app import run  # imports TensorFlow

    sys.exit(run(settings))


def _stop_before_serving(signum, _frame) -> None:
    logging.getLogger("servex").info("%s before serving: stopped", signal.Signals(signum).name)
    raise SystemExit(0)


if __name__ == "__main__":
    main()
